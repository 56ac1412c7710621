"""Tier 1: the overlap pass fuses each copy_to with the column-parallel linears of its class into one
rt.copy_to_linears node; code generation prints that node, and the plan reads it."""

from __future__ import annotations

import dataclasses
import operator
from unittest import mock

import pytest
import torch
from fxshard.passes import PASSES, registered

from fxshard import compiler
from fxshard.compiler import compile_program
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout, spec
from fxshard.ir.contracts import ContractError
from fxshard.ir.placement import Shard
from fxshard.runtime import collectives as rtc

aten = torch.ops.aten


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is rtc.copy_to_linears]


def test_a_copy_to_and_its_linear_become_one_node_that_the_rank_file_prints(models):
    result = compile_model(models / "mlp.py", Layout(tp=2))
    gm = result.gm
    (fused,) = _fused(gm)
    assert not any(n.target is rtc.copy_to for n in gm.graph.nodes)
    assert [w.name for w in fused.kwargs["weights"]] == ["p_model_mlp_fc_in_weight"]
    assert [b.name for b in fused.kwargs["biases"]] == ["p_model_mlp_fc_in_bias"]
    (linear,) = fused.users  # the linear, in place: its name, placement and role kept, now the fused op's output 0
    assert linear.target is operator.getitem and linear.args == (fused, 0) and linear.name == "linear"
    assert spec(linear).placement == Shard(1) and spec(linear).role == "column-parallel" and spec(linear).inputs == ()
    assert spec(fused).collective == "copy_to_linears" and spec(fused).placement == (Shard(1),)
    code = result.sources["rank_pp0_tp0.py"]
    assert (f"{fused.name} = rt.copy_to_linears(layer_norm, self.tp, weights=(self.mlp_fc_in_weight,), "
            "biases=(self.mlp_fc_in_bias,))") in code
    assert f"linear = {fused.name}[0]" in code


def test_without_overlap_the_graph_keeps_the_copy_to_and_the_linears(models):
    result = compile_program(models / "mlp.py", Layout(tp=2, overlap=False))
    assert "overlap" not in result.ctx.passes_run and not _fused(result.gm)
    (copy,) = [n for n in result.gm.graph.nodes if n.target is rtc.copy_to]
    assert [u.target for u in copy.users] == [aten.linear.default]


def test_q_k_v_share_one_fused_node_inside_the_block_that_runs_them(samples):
    gm = compile_program(samples / "llama.py", Layout(tp=2)).gm
    fused = _fused(gm)
    layer = [n for n in fused if spec(n).block == "model.layers.1"]
    assert len(fused) == 9 and len(layer) == 2  # per layer: q/k/v and gate/up; and the LM head
    attention, mlp = layer
    assert [w.name for w in attention.kwargs["weights"]] == [f"p_model_model_layers_1_self_attn_{p}_proj_weight"
                                                             for p in "qkv"]
    assert [w.name for w in mlp.kwargs["weights"]] == [f"p_model_model_layers_1_mlp_{p}_proj_weight"
                                                       for p in ("gate", "up")]
    assert all(spec(u).block == "model.layers.1" for u in attention.users)
    (head,) = [n for n in fused if not spec(n).block]
    assert [w.name for w in head.kwargs["weights"]] == ["p_model_lm_head_weight"]
    assert spec(head).placement == (Shard(2),)


def test_a_copy_to_read_by_other_ops_than_linears_stays(samples):
    # GPT-2's Conv1D lowers to addmm: its copy_to stays; the LM head's linear is fused
    gm = compile_program(samples / "gpt2.py", Layout(tp=2)).gm
    kept = [n for n in gm.graph.nodes if n.target is rtc.copy_to]
    assert kept and all(aten.addmm.default in {u.target for u in n.users} for n in kept)
    assert len(_fused(gm)) == 1


def test_the_zero_bubble_schedule_keeps_copy_to(samples):
    result = compile_program(samples / "gpt.py", Layout(tp=2, pp=2, schedule="zero-bubble"))
    assert "overlap" not in result.ctx.passes_run and not _fused(result.gm)


def test_a_fused_node_read_other_than_by_index_breaks_the_contract(models):
    overlap = registered("overlap")

    def leaky_overlap_pass(gm, ctx):
        gm = overlap.run(gm, ctx)
        (fused,) = _fused(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.args = ((*out.args[0], fused),)  # returned whole: nothing reads a tuple so in a rank file
        return gm

    passes = [dataclasses.replace(p, run=leaky_overlap_pass) if p is overlap else p for p in PASSES]
    with mock.patch.object(compiler, "PASSES", passes), pytest.raises(
            ContractError, match=r"leaky_overlap_pass ensures 'copy_to fused.*', but after it output reads "
                                 r"copy_to_linears other than as one of its outputs in its class"):
        compile_program(models / "mlp.py", Layout(tp=2))


@pytest.mark.slow
def test_the_plan_reads_the_fused_node(samples):
    """fxshard plan compiles in memory and costs that graph: it holds the fused nodes, their backward all-reduces
    are counted as the copy_to's were, and no value is counted for the copy_to output the fused op does not make."""
    from fxshard.cost.costs import B, S, plan_costs

    fused = _fused(compile_program(samples / "gpt.py", Layout(tp=2)).gm)
    assert len(fused) == 17  # per block q/k/v and the MLP's input, and the LM head
    (overlapped,) = plan_costs(samples / "gpt.py", Layout(tp=2)).ranks
    (plain,) = plan_costs(samples / "gpt.py", Layout(tp=2, overlap=False)).ranks
    for key in ("tp_allreduce", "tp_allgather", "tp_sent", "saved", "peak"):
        assert overlapped[key].expr == plain[key].expr, key
    hidden = 64 * 4  # bytes per token of a [B, S, 64] f32 value, what each copy_to made
    assert plain["forward_values"].expr - overlapped["forward_values"].expr == 17 * hidden * B * S
