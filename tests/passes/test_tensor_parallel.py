"""Tier 1: the tensor-parallel and collectives passes on single-process graphs."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

from fxshard.compiler import compile_program
from fxshard.driver import compile as compile_model
from fxshard.errors import PlanError, ShardingError
from fxshard.ir.context import Layout, spec
from fxshard.ir.placement import Partial, Replicate, Shard
from fxshard.runtime import collectives as rtc
from fxshard.runtime import tensor_parallel as rt_tp

aten = torch.ops.aten


def _collectives(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in rtc.COLLECTIVES.values()]


def _counts(gm):
    """(forward all-reduces, backward all-reduces) issued by one rank per step (a copy_to fused with its linears,
    passes/overlap.py, all-reduces backward as the copy_to did)."""
    nodes = _collectives(gm)
    fwd = sum(n.target is rtc.all_reduce for n in nodes)
    bwd = sum(n.target in (rtc.copy_to, rtc.copy_to_linears) for n in nodes)
    return fwd, bwd


def test_mlp_issues_one_all_reduce_each_way(models):
    gm = compile_program(models / "mlp.py", Layout(tp=2)).gm
    assert _counts(gm) == (1, 1)
    fused = next(n for n in gm.graph.nodes if n.target is rtc.copy_to_linears)  # fc_in's input, overlapped
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default or n.args[:1] == (fused,)]
    assert [spec(n).placement for n in linears] == [Shard(1), Partial()]
    assert [spec(n).role for n in linears] == ["column-parallel", "row-parallel"]
    weights = {n.name: spec(n).placement for n in gm.graph.nodes if n.op == "placeholder"}
    assert weights["p_model_mlp_fc_in_weight"] == Shard(0)
    assert weights["p_model_mlp_fc_in_bias"] == Shard(0)
    assert weights["p_model_mlp_fc_out_weight"] == Shard(1)
    assert weights["p_model_mlp_fc_out_bias"] == Replicate()


def test_mlp_generated_code_counts_and_bias_after_reduce(models, tmp_path):
    result = compile_model(models / "mlp.py", Layout(tp=2), out=tmp_path)
    code = result.sources["rank_pp0_tp0.py"]
    assert code.count("rt.all_reduce(") == 1
    assert code.count("rt.copy_to_linears(") == 1 and "rt.copy_to(" not in code  # fc_in's, overlapped
    # the row-parallel bias is added once, after the reduction
    lines = code.splitlines()
    reduce_line = next(i for i, ln in enumerate(lines) if "rt.all_reduce(" in ln)
    assert "mlp_fc_out_bias" in lines[reduce_line + 1] and "aten.add.Tensor" in lines[reduce_line + 1]
    assert "# mlp.fc_in  Linear  column-parallel" in code
    assert "# mlp.fc_out  Linear  row-parallel" in code


@pytest.mark.parametrize("sample,layers", [("gpt.py", 8), ("llama.py", 4), ("gpt2.py", 4)])
def test_two_all_reduces_each_way_per_transformer_layer(samples, sample, layers):
    gm = compile_program(samples / sample, Layout(tp=2)).gm
    fwd, bwd = _counts(gm)
    # + 1 forward all-reduce for the vocabulary-parallel embedding, + 1 backward for the output head
    assert (fwd, bwd) == (2 * layers + 1, 2 * layers + 1)
    # the loss is a vocab-parallel cross entropy: it gathers 2 numbers per token, never the logits; the
    # logits are gathered once, for the model's returned output
    gathers = [n for n in _collectives(gm) if n.target is rtc.all_gather]
    assert len(gathers) == 2
    loss_parts, logits = gathers
    assert loss_parts.args[0].target is rt_tp.vocab_cross_entropy_parts
    assert [u.target for u in loss_parts.users] == [rt_tp.vocab_cross_entropy]
    assert list(loss_parts.meta["val"].shape)[1:] == [2, 2]
    assert [u.op for u in logits.users] == ["output"]


@pytest.mark.parametrize("model", ["smoothed_loss.py", "soft_targets.py"])
def test_cross_entropy_needing_the_whole_logits_gathers_them(models, model):
    """Label smoothing and probability targets have no vocab-parallel rule: the logits are all-gathered
    first, and the compile says so."""
    result = compile_program(models / model, Layout(tp=2))
    gathers = [n for n in _collectives(result.gm) if n.target is rtc.all_gather]
    assert len(gathers) == 1 and [u.target for u in gathers[0].users] != [rt_tp.vocab_cross_entropy_parts]
    assert any("gathered whole for the cross entropy" in note for note in result.ctx.notes)


def test_attention_shapes_are_localized_to_heads(samples):
    from fxshard.passes import saved_activations  # without its GQA rewrite, which drops repeat_kv (checked below)

    with mock.patch.object(saved_activations, "REWRITES", [r for r in saved_activations.REWRITES if r[0] != "gqa"]):
        gm = compile_program(samples / "llama.py", Layout(tp=2)).gm
    views = [n for n in gm.graph.nodes if n.target is aten.view.default and spec(n).fqn == "model.layers.0.self_attn"]
    # q: [B, S, 8 heads, 8] -> [B, S, 4, 8]; k, v: [B, S, 4 kv heads, 8] -> [B, S, 2, 8]
    assert [list(v.args[1]) for v in views[:3]] == [[4, 16, 4, 8], [4, 16, 2, 8], [4, 16, 2, 8]]
    expands = [n for n in gm.graph.nodes if n.target is aten.expand.default
               and spec(n).fqn == "model.layers.0.self_attn"]
    assert [list(e.args[1]) for e in expands] == [[4, 2, 2, 16, 8], [4, 2, 2, 16, 8]]  # repeat_kv, per rank
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert spec(sdpa).placement == Shard(1)
    gm = compile_program(samples / "llama.py", Layout(tp=2)).gm  # k and v into attention at the kv heads
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert sdpa.kwargs["enable_gqa"] and not any(n.target is aten.expand.default for n in gm.graph.nodes)


def test_gpt2_fused_qkv_is_a_packed_column_split(samples):
    gm = compile_program(samples / "gpt2.py", Layout(tp=2)).gm
    c_attn = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name.endswith("h_0_attn_c_attn_weight"))
    assert spec(c_attn).placement == Shard(1, blocks=3)
    split = next(n for n in gm.graph.nodes if n.target is aten.split.Tensor)
    assert split.args[1] == 32  # 64 per block, over tp=2
    assert spec(split).placement == (Shard(2), Shard(2), Shard(2))


def test_tp_that_does_not_divide_heads_names_module_and_valid_degrees(models):
    with pytest.raises(ShardingError) as e:
        compile_program(models / "odd_heads.py", Layout(tp=4))
    msg = str(e.value)
    assert "attn" in msg and "6 heads (num_heads)" in msg and "tp=4" in msg and "{1, 2, 3, 6}" in msg


def _suggested_degrees(path, tp: int) -> list[int]:
    with pytest.raises(ShardingError) as e:
        compile_program(path, Layout(tp=tp))
    return [int(d) for d in re.search(r"use tp in \{([\d, ]+)\}", str(e.value)).group(1).split(", ")]


@pytest.mark.slow
@pytest.mark.parametrize("sample", [pytest.param("gpt.py", marks=pytest.mark.matrix), "llama.py",
                                    pytest.param("gpt2.py", marks=pytest.mark.matrix)])  # make test keeps llama's
def test_every_suggested_tp_degree_compiles_and_the_others_fail(samples, sample):
    # gpt: 4 heads of hidden 64; llama: 8 heads, 4 key/value heads, vocab 256: at tp=8 the heads fewer than tp are
    # each held by tp/heads ranks (issue 31 section 2), so 8 is offered and compiles (the headline --tp 8);
    # gpt2: fused q/k/v, 3 packed blocks of 64, 4 heads: 8 fails on the packed heads
    suggested = _suggested_degrees(samples / sample, 3)
    assert suggested[:3] == [1, 2, 4] and (8 in suggested) == (sample != "gpt2.py"), suggested
    for tp in suggested[:4]:
        compile_program(samples / sample, Layout(tp=tp))
    if sample == "gpt2.py":
        assert _suggested_degrees(samples / sample, 8) == suggested  # 8 divides hidden and vocab, not the heads


def test_plan_key_matching_nothing_warns_with_its_name(models):
    with pytest.warns(UserWarning, match="'mlp.fc_middle' matches no module"):
        compile_program(models / "mlp.py", Layout(tp=2), plan={"mlp.fc_in": "colwise", "mlp.fc_out": "rowwise",
                                                               "mlp.fc_middle": "colwise"})


def test_user_plan_overrides_and_conflicting_tied_split_is_an_error(samples):
    with pytest.raises(PlanError, match="tied with"):
        compile_program(samples / "gpt.py", Layout(tp=2), plan={"wte": "vocab", "lm_head": "rowwise"})


def test_decorators_steer_the_split(samples):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx = compile_program(samples / "annotated.py", Layout(tp=2)).ctx
    assert ctx.plan.source == "decorator"
    assert str(ctx.plan.styles["mlps.1.up"]) == "colwise()"
    assert str(ctx.plan.styles["mlps.1.down"]) == "rowwise()"
    assert str(ctx.plan.styles["head"]) == "replicate()"


def test_shipped_hf_plan_is_used(samples):
    ctx = compile_program(samples / "llama.py", Layout(tp=2)).ctx
    assert ctx.plan.source == "model"
    assert ctx.plan.sources["model.layers.1.mlp.down_proj"] == "model"


def test_compile_is_byte_identical_twice(samples, tmp_path):
    a = compile_model(samples / "gpt2.py", Layout(tp=2), out=tmp_path / "a")
    compile_model(samples / "gpt2.py", Layout(tp=2), out=tmp_path / "b")
    for name in ["manifest.json", *a.files, "weights/rank_pp0_tp0.safetensors", "weights/rank_pp0_tp1.safetensors"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_generated_code_imports_only_torch_and_runtime(samples, tmp_path):
    result = compile_model(samples / "llama.py", Layout(tp=2), out=tmp_path)
    code = result.sources["rank_pp0_tp1.py"]
    imports = [ln for ln in code.splitlines() if ln.startswith(("import ", "from "))]
    assert imports == ["import torch", "from fxshard import runtime as rt"]
    assert "# mlp.down_proj  Linear  row-parallel" in code  # in the class of the decoder layers
    assert "self.model_layers_0 = LlamaDecoderLayer(groups, self.device)  # model.layers.0" in code
    assert "start=128, end=256" in code  # rank 1's vocabulary rows


def test_a_partial_sum_read_by_split_compute_is_reduced_not_the_weights_gathered(models):
    # OLMo2's first block: the vocab-parallel lookup feeds q/k/v directly; here a Linear and a matmul
    result = compile_program(models / "partial_into_split.py", Layout(tp=2))
    assert not [n for n in result.ctx.notes if "aten.linear" in n or "aten.matmul" in n], result.ctx.notes
    weight = next(n for n in result.gm.graph.nodes if n.name == "p_model_proj_weight")
    assert spec(weight).placement == Shard(0)


@pytest.mark.distributed
def test_a_partial_sum_read_by_split_compute_trains_like_one_device(models):
    from fxshard.driver import verify

    result = verify(models / "partial_into_split.py", Layout(tp=2), steps=3)
    assert result.ok, result.summary()


def test_a_bias_added_after_the_reduction_gets_its_copy_to_into_split_compute(models):
    # the add is inserted by the tensor-parallel pass; whether a gradient flows back through it is asked of the
    # graph as it is then (fxshard.ir.autograd), so its gradient, a partial sum over tp, is all-reduced
    code = compile_model(models / "bias_into_split.py", Layout(tp=2)).sources["rank_pp0_tp0.py"]
    assert "copy_to_linears = rt.copy_to_linears(add_tensor, self.tp, weights=(self.c_weight,)" in code


@pytest.mark.distributed
def test_a_bias_added_after_the_reduction_into_split_compute_trains_like_one_device(models):
    from fxshard.driver import verify

    result = verify(models / "bias_into_split.py", Layout(tp=2), steps=3)
    assert result.ok, result.summary()


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True])
def test_a_reduced_output_split_along_its_bias_dimension_adds_the_bias_whole(models, sp):
    # review of --sp: the bias add took its consumer's hidden-size split as a token split and failed to compile
    from fxshard.driver import verify

    result = verify(models / "bias_beside_split.py", Layout(tp=2, sp=sp), steps=3)
    assert result.ok, result.summary()


def test_an_embedding_scaling_gradients_by_frequency_is_looked_up_whole(tmp_path):
    # the frequencies are counted over the whole lookup: split rows would count every other rank's ids as row 0
    model = tmp_path / "freq.py"
    model.write_text((Path(__file__).resolve().parents[1] / "models" / "padded_embedding.py").read_text()
                     .replace("nn.Embedding(64, 16, padding_idx=1)", "nn.Embedding(64, 16, scale_grad_by_freq=True)"))
    sources = compile_model(model, Layout(tp=2)).sources
    code = sources["rank_pp0_tp0.py"]
    assert code.count("rt.vocab_embedding(") == 1  # the other lookup (padding row, no frequency scaling) stays split
    assert "aten.embedding.default(" in code and "True)" in code.split("aten.embedding.default(")[1].split("\n")[0]
