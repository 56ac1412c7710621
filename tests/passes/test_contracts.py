"""Tier 1: the pass registry (``fxshard.passes.PASSES``) declares what each pass requires and ensures, and the driver
holds the list to it: a list out of order is refused before any pass runs, naming the fact, and a pass that leaves a
fact untrue is named."""

from __future__ import annotations

import dataclasses
import re
from unittest import mock

import pytest
import torch
from fxshard.passes import PASSES, registered

from fxshard import compiler
from fxshard.compiler import CODEGEN_REQUIRES, compile_program
from fxshard.ir.context import Layout, spec, update_spec
from fxshard.ir.contracts import STAGED, ContractError, Pass, check_order


def _compile_with(passes, model, layout):
    with mock.patch.object(compiler, "PASSES", passes):
        return compile_program(model, layout)


def _moved(name: str, before: str | None) -> list[Pass]:
    """PASSES with ``name`` moved to just before ``before`` (None: to the end)."""
    entry = registered(name)
    rest = [p for p in PASSES if p is not entry]
    at = len(rest) if before is None else rest.index(registered(before))
    return [*rest[:at], entry, *rest[at:]]


@pytest.mark.parametrize("model", ["gpt.py", "llama.py"])
def test_the_real_passes_keep_every_contract(samples, model):
    check_order(PASSES, CODEGEN_REQUIRES)
    layout = Layout(tp=2, pp=2)
    result = compile_program(samples / model, layout)  # the driver checks each pass's facts
    layout_passes = [p for p in PASSES if p.layout_gate is None or p.layout_gate(layout)]  # expert_parallel: --ep
    # a pass with a program gate runs where the program needs it (router_loss: a load-balancing loss under --dp),
    # judged on the program it receives, which its own work can change (causal_attention drops the mask it acts
    # on): each that still applies after compile ran, and every pass ran in PASSES' order
    ran = result.ctx.passes_run
    assert ran[0] == "capture"
    assert ran[1:] == [p.name for p in layout_passes if p.program_gate is None or p.name in ran]
    assert all(p.name in ran for p in layout_passes if p.program_gate is not None and p.program_gate(result.ctx))
    assert ("causal_attention" in ran) == (model == "llama.py")  # transformers' Llama builds its causal mask
    for fact in CODEGEN_REQUIRES:
        assert fact.broken(result.gm, result.ctx) is None, fact
    assert {spec(n).stage for n in result.gm.graph.nodes} == {None, 0, 1}


# the order rules that once lived in comments: each pass that changes the global program before the placements are
# decided ensures a fact the tensor-parallel pass requires (the cp split reads the first two as well)
@pytest.mark.parametrize(("name", "before", "by", "fact"), [
    ("tensor_parallel", "token_mean", "tensor_parallel", "token means made whole-step"),
    ("tensor_parallel", "causal_attention", "tensor_parallel", "causal masks proven"),
    ("tensor_parallel", "context_parallel", "tensor_parallel", "the sequence split over cp"),
    ("context_parallel", "collectives", "tensor_parallel", "the sequence split over cp"),
    ("token_mean", "collectives", "context_parallel", "token means made whole-step"),
    ("causal_attention", "collectives", "context_parallel", "causal masks proven"),
])
def test_a_pass_moved_out_of_order_is_refused_naming_the_fact(name, before, by, fact):
    with pytest.raises(ContractError, match=rf"^{by}_pass requires '{fact}.*', which no pass before it ensures"):
        check_order(_moved(name, before), CODEGEN_REQUIRES)


def test_every_pass_moved_before_what_it_requires_is_refused():
    """Every entry with a requirement, moved to the front, is refused naming its first requirement; every pass that
    ensures a fact another pass requires, moved to the end, is refused naming that fact."""
    for entry in PASSES:
        rest = [p for p in PASSES if p is not entry]
        if entry.requires:
            with pytest.raises(ContractError, match=re.escape(f"{entry.run.__name__} requires {entry.requires[0]}")):
                check_order([entry, *rest], CODEGEN_REQUIRES)
        needed = [f for f in entry.ensures if any(f in p.requires for p in rest)]  # codegen reads after the end
        if needed and not any(set(needed) & set(p.ensures) for p in rest):
            named = "|".join(re.escape(f.name) for f in needed)
            with pytest.raises(ContractError, match=rf"requires [\"']({named})[\"'], which no pass before it ensures"):
                check_order([*rest, entry], CODEGEN_REQUIRES)


def test_a_pass_before_the_one_it_relies_on_is_refused(samples):
    swapped = _moved("collectives", "tensor_parallel")
    with pytest.raises(ContractError, match=r"collectives_pass requires 'tensor-parallel placements decided.*', "
                                            r"which no pass before it ensures \(tensor_parallel_pass ensures it, "
                                            r"later in the list\)"):
        _compile_with(swapped, samples / "gpt.py", Layout(tp=2, pp=2))


def test_a_pass_list_leaving_out_what_codegen_reads_is_refused(samples):
    without_dropout = [p for p in PASSES if p.name != "dropout"]
    with pytest.raises(ContractError, match=r"codegen requires 'dropout rewritten.*', which no pass before it "
                                            r"ensures \(no pass in the list ensures it\)"):
        _compile_with(without_dropout, samples / "gpt.py", Layout(tp=2))


def test_a_pass_outside_the_registry_is_refused(samples):
    def bare_pass(gm, ctx):
        return gm

    with pytest.raises(ContractError, match=r"bare_pass is not a registry entry; add it to fxshard.passes.PASSES"):
        _compile_with([*PASSES, bare_pass], samples / "gpt.py", Layout(tp=2))


def test_a_pass_that_does_not_deliver_what_it_ensures_is_named(samples):
    def idle_pipeline_pass(gm, ctx):
        return gm

    passes = [dataclasses.replace(p, run=idle_pipeline_pass) if p.name == "pipeline" else p for p in PASSES]
    with pytest.raises(ContractError, match=r"idle_pipeline_pass ensures 'pipeline stages assigned.*', but after it "
                                            r"no cut is recorded"):
        _compile_with(passes, samples / "gpt.py", Layout(pp=2))


def test_a_graph_change_after_the_cut_that_leaves_a_node_without_stage_is_named(samples):
    # the stale-side-table problem the stages in NodeSpec solve: a later pass must give its nodes a stage
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
        _compile_with([*PASSES, Pass(late_pass)], samples / "gpt.py", Layout(pp=2))
