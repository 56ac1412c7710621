"""Tier 1: every pass declares what it requires and ensures, and the driver holds the pass list to it: a list
out of order is refused before any pass runs, and a pass that leaves a fact untrue is named."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
from fxshard.passes.checks import checks_pass
from fxshard.passes.collectives import collectives_pass
from fxshard.passes.dropout import dropout_pass
from fxshard.passes.pipeline import pipeline_pass
from fxshard.passes.tensor_parallel import tensor_parallel_pass
from fxshard.passes.token_mean import token_mean_pass

from fxshard import compiler
from fxshard.compiler import CODEGEN_REQUIRES, PASSES, compile_program
from fxshard.ir.context import Layout, spec, update_spec
from fxshard.ir.contracts import STAGED, ContractError, check_order, contract, contract_of


def _compile_with(passes, model, layout):
    with mock.patch.object(compiler, "PASSES", passes):
        return compile_program(model, layout)


@pytest.mark.parametrize("model", ["gpt.py", "llama.py"])
def test_the_real_passes_keep_every_contract(samples, model):
    check_order(PASSES, CODEGEN_REQUIRES)
    layout = Layout(tp=2, pp=2)
    result = compile_program(samples / model, layout)  # the driver checks each pass's facts
    name = {p: p.__name__.removesuffix("_pass") for p in PASSES}
    layout_passes = [p for p in PASSES if getattr(p, "applies", lambda _: True)(layout)]  # expert_parallel: --ep only
    # a pass with applies_to runs where the program needs it (router_loss: a load-balancing loss under --dp), judged
    # on the program it receives, which its own work can change (causal_attention drops the mask it acts on): each
    # that still applies after compile ran, and every pass ran in PASSES' order
    ran = result.ctx.passes_run
    assert ran[0] == "capture"
    assert ran[1:] == [name[p] for p in layout_passes if not hasattr(p, "applies_to") or name[p] in ran]
    assert all(name[p] in ran for p in layout_passes if getattr(p, "applies_to", lambda _: False)(result.ctx))
    assert ("causal_attention" in ran) == (model == "llama.py")  # transformers' Llama builds its causal mask
    for fact in CODEGEN_REQUIRES:
        assert fact.broken(result.gm, result.ctx) is None, fact
    assert {spec(n).stage for n in result.gm.graph.nodes} == {None, 0, 1}


def test_a_pass_before_the_one_it_relies_on_is_refused(samples):
    swapped = [token_mean_pass, collectives_pass, tensor_parallel_pass, dropout_pass, pipeline_pass, checks_pass]
    with pytest.raises(ContractError, match=r"collectives_pass requires 'tensor-parallel placements decided.*', "
                                            r"which no pass before it ensures \(tensor_parallel_pass ensures it, "
                                            r"later in the list\)"):
        _compile_with(swapped, samples / "gpt.py", Layout(tp=2, pp=2))


def test_a_pass_list_leaving_out_what_codegen_reads_is_refused(samples):
    without_dropout = [p for p in PASSES if p is not dropout_pass]
    with pytest.raises(ContractError, match=r"codegen requires 'dropout rewritten.*', which no pass before it "
                                            r"ensures \(no pass in the list ensures it\)"):
        _compile_with(without_dropout, samples / "gpt.py", Layout(tp=2))


def test_a_pass_must_declare_its_contract(samples):
    def bare_pass(gm, ctx):
        return gm

    with pytest.raises(ContractError, match="bare_pass declares no contract"):
        _compile_with([*PASSES, bare_pass], samples / "gpt.py", Layout(tp=2))


def test_a_pass_that_does_not_deliver_what_it_ensures_is_named(samples):
    @contract(ensures=contract_of(pipeline_pass).ensures)
    def idle_pipeline_pass(gm, ctx):
        return gm

    passes = [idle_pipeline_pass if p is pipeline_pass else p for p in PASSES]
    with pytest.raises(ContractError, match=r"idle_pipeline_pass ensures 'pipeline stages assigned.*', but after it "
                                            r"no cut is recorded"):
        _compile_with(passes, samples / "gpt.py", Layout(pp=2))


def test_a_graph_change_after_the_cut_that_leaves_a_node_without_stage_is_named(samples):
    # the stale-side-table problem the stages in NodeSpec solve: a later pass must give its nodes a stage
    @contract()
    def late_pass(gm, ctx):
        loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        x = loss.args[0]
        with gm.graph.inserting_before(loss):
            copy = gm.graph.call_function(torch.ops.aten.clone.default, (x,))
        copy.meta["val"] = x.meta["val"]
        update_spec(copy, placement=spec(x).placement, inputs=(spec(x).placement,))
        loss.replace_input_with(x, copy)
        return gm

    with pytest.raises(ContractError, match=re.escape(f"late_pass breaks {STAGED}, which pipeline_pass ensured: "
                                                      "after it clone_default computes the loss but has no stage")):
        _compile_with([*PASSES, late_pass], samples / "gpt.py", Layout(pp=2))
