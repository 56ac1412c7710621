"""Tier 1: ``--sp`` (sequence parallelism) in the tensor-parallel and collectives passes, on single-process
graphs: which collectives each transformer layer issues, what stays whole and why, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy
import torch

from fxshard.compiler import compile_program
from fxshard.cost.costs import plan_costs
from fxshard.errors import LayoutError, ShardingError
from fxshard.ir.context import Layout, spec
from fxshard.ir.placement import Partial, Replicate, Shard
from fxshard.runtime import collectives as rtc

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"


def _nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _block(gm, prefix: str):
    return [n for n in _nodes(gm) if spec(n).fqn == prefix or spec(n).fqn.startswith(prefix + ".")]


@pytest.mark.parametrize("sample, prefix", [("gpt.py", "blocks.3"), ("llama.py", "model.layers.1")])
def test_each_layer_reduce_scatters_after_row_parallel_and_gathers_before_column_parallel(sample, prefix):
    gm = compile_program(SAMPLES / sample, Layout(tp=2, sp=True)).gm
    block = _block(gm, prefix)
    calls = [n.target.__name__ for n in block if n.target in rtc.COLLECTIVES.values()]
    # no all-reduce of an activation is left in the layer: the two row-parallel outputs are reduce-scattered
    # along the sequence, the two column-parallel inputs (q/k/v share one; the MLP's gate/up share one) gathered
    assert "all_reduce" not in calls
    assert calls.count("reduce_scatter") == 2 and calls.count("gather_to") == 2
    for n in block:
        if n.target is rtc.reduce_scatter:
            (producer,) = n.all_input_nodes
            assert spec(producer).role == "row-parallel" and spec(producer).placement == Partial()
            assert n.kwargs == {"dim": 1} and spec(n).placement == Shard(1)
        if n.target is rtc.gather_to:
            assert n.kwargs == {"dim": 1} and spec(n).placement == Replicate()
            # read by the column-parallel linears, fused to keep its shard (rt.linears_regathered, passes/overlap.py)
            assert all(u.target is rtc.linears_regathered and u.kwargs["shard"] is n.args[0] for u in n.users)
            assert {spec(g).role for u in n.users for g in u.users} == {"column-parallel"}
    # what runs between them runs on S/tp tokens: the norms and the residual adds
    norms = [n for n in block if n.target in (aten.layer_norm.default, aten.rsqrt.default)]
    assert norms and all(spec(n).placement == Shard(1) for n in norms)
    adds = [n for n in block if n.target is aten.add.Tensor and n.meta["val"].dim() == 3]
    assert adds and all(spec(n).placement == Shard(1) for n in adds)


@pytest.mark.parametrize("sample, weights", [("gpt.py", {"ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
                                                          "attn.o_proj.bias", "mlp.fc_out.bias"}),
                                              ("llama.py", {"input_layernorm.weight",
                                                            "post_attention_layernorm.weight"})])
def test_replicated_weights_used_on_the_token_split_get_their_gradient_summed_over_tp(sample, weights):
    """Each rank computes the norm weights' gradient from its own tokens: copy_to all-reduces it backward."""
    result = compile_program(SAMPLES / sample, Layout(tp=2, sp=True))
    state = result.ctx.program.state_by_name()
    prefix = "blocks.3." if sample == "gpt.py" else "model.layers.1."
    summed = {state[n.args[0].name].fqn.removeprefix(prefix) for n in _nodes(result.gm)
              if n.target is rtc.copy_to and n.args[0].op == "placeholder" and n.args[0].name in state
              and state[n.args[0].name].fqn.startswith(prefix)}
    assert summed == weights


def test_the_embedding_is_reduce_scattered_and_only_the_loss_parts_and_returned_logits_are_plain_gathers():
    gm = compile_program(SAMPLES / "gpt.py", Layout(tp=2, sp=True)).gm
    scattered = [n for n in _nodes(gm) if n.target is rtc.reduce_scatter]
    assert spec(scattered[0].args[0]).role == "vocab-parallel"  # the embedding's lookup, a partial sum
    # left whole on purpose: all_gather (backward: keep this rank's part) only where replicated compute reads
    # a split value: the cross entropy's two numbers per token and the logits the model returns
    gathers = [n for n in _nodes(gm) if n.target is rtc.all_gather]
    assert [spec(n.args[0]).role for n in gathers] == ["vocab-parallel cross entropy", "column-parallel"]
    # the only all-reduce left anywhere is none: the embedding's forward all-reduce became the reduce-scatter
    assert not [n for n in _nodes(gm) if n.target is rtc.all_reduce]


def test_rank_file_lines(tmp_path):
    from fxshard.driver import compile as compile_model

    result = compile_model(SAMPLES / "gpt.py", Layout(tp=2, sp=True), out=tmp_path)
    code = result.sources["rank_pp0_tp0.py"]
    assert "reduce_scatter = rt.reduce_scatter(linear_3, self.tp, dim=1)" in code
    assert "gather_to = rt.gather_to(layer_norm, self.tp, dim=1)" in code
    assert "copy_to = rt.copy_to(self.ln_1_weight, self.tp)" in code
    assert "# layout:   tp=2 pp=1 dp=1 zero=0 sp;" in code
    assert result.manifest.layout.sp


def test_pipeline_boundaries_send_the_token_split():
    from fxshard.ir.stages import pipeline_stages

    result = compile_program(SAMPLES / "gpt.py", Layout(tp=2, pp=2, sp=True))
    stages = pipeline_stages(result.gm, result.ctx)
    hidden = [v for v in stages[0].outputs if v.meta["val"].dim() == 3]
    assert hidden and all(spec(v).placement == Shard(1) for v in hidden)


@pytest.mark.slow
def test_the_same_elements_go_over_the_wire_as_the_all_reduces_replaced():
    tp, sp = (plan_costs(SAMPLES / "llama.py", Layout(tp=2, sp=s)).ranks[0] for s in (False, True))
    # every activation all-reduce becomes a reduce-scatter plus an all-gather of the same buffer: (t-1)/t each
    # instead of 2(t-1)/t; what --sp adds is the norm weights' gradients (576 elements, no B or S) and the
    # column-parallel inputs gathered again in backward (rt.linears_regathered: 4 layers x 2 and the head, 64 wide)
    assert sympy.simplify(sp["tp_reducescatter"].expr - tp["tp_allreduce"].expr) == 0
    extra = sympy.expand(sp["tp_sent"].expr - tp["tp_sent"].expr - 576)
    assert extra.subs({x: {"B": 3, "S": 5}[str(x)] for x in extra.free_symbols}) == 9 * 64 * 3 * 5 // 2
    assert sp["saved"].value < tp["saved"].value


def test_sp_at_tp1_is_refused_before_anything_runs():
    with pytest.raises(LayoutError, match=r"--sp splits the sequence over the tensor-parallel ranks.*--tp 2"):
        Layout(sp=True)


def test_cli_refuses_sp_at_tp1():
    from fxshard.cli.app import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["plan", str(SAMPLES / "gpt.py"), "--sp"])
    assert result.exit_code == 2 and "--sp" in result.output and "tp=1" in result.output


def test_a_sequence_length_tp_does_not_divide_names_the_module(tmp_path):
    model = tmp_path / "odd_seq.py"
    model.write_text((SAMPLES / "gpt.py").read_text().replace("VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = 256, 16",
                                                              "VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = 256, 15"))
    with pytest.raises(ShardingError, match=r"^wte: --sp splits its output \[8, 15, 64\] over tp=2 along dimension 1, "
                                            r"the sequence \(15 tokens\).*drop --sp"):
        compile_program(model, Layout(tp=2, sp=True))
    compile_program(model, Layout(tp=2))  # without --sp the same model compiles


def test_without_sp_nothing_changes():
    gm = compile_program(SAMPLES / "gpt.py", Layout(tp=2)).gm
    assert not [n for n in _nodes(gm) if n.target in (rtc.reduce_scatter, rtc.gather_to)]


def test_a_model_without_token_activations_says_sp_splits_nothing(models):
    result = compile_program(models / "mlp.py", Layout(tp=2, sp=True))  # [4, 16] activations: no sequence
    assert any(n.startswith("--sp: no value is split over tokens") for n in result.ctx.notes)
    assert not [n for n in _nodes(result.gm) if n.target in (rtc.reduce_scatter, rtc.gather_to)]
