"""Tier 1: the blocks pass records in the graph which repeated blocks each generated class calls as a submodule;
code generation and the plan read that record, not a search of their own."""

from __future__ import annotations

import dataclasses
import re
from unittest import mock

import pytest
from fxshard.passes import PASSES, registered

from fxshard import compiler
from fxshard.compiler import compile_program
from fxshard.driver import compile as compile_model
from fxshard.ir.blocks import block_units, bodies
from fxshard.ir.context import Layout, spec, update_spec
from fxshard.ir.contracts import ContractError
from fxshard.ir.cut import under


def _units(result):
    """(stage, block) -> unit, for every class of the compiled program."""
    found = {}
    for body in bodies(result.gm, result.ctx):
        for unit in block_units(body.nodes, body.state, body.keep, body.apart).values():
            found[(body.stage, unit.fqn)] = unit
    return found


def test_each_block_is_recorded_on_its_nodes_and_called_as_a_submodule(samples):
    result = compile_model(samples / "gpt.py", Layout(tp=2))
    units = _units(result)
    assert sorted(units) == [(None, f"blocks.{i}") for i in range(8)]
    for (_, fqn), unit in units.items():
        assert all(spec(n).block == fqn and under(spec(n).fqn, fqn) for n in unit.nodes)
        assert [n.name for n in unit.outputs] == [unit.nodes[-1].name]  # the residual stream, its last add
    called = re.findall(r"= self\.(blocks_\d+)\(", result.sources["rank_pp0_tp0.py"])
    assert called == [f"blocks_{i}" for i in range(8)]
    outside = [n for n in result.gm.graph.nodes if n.op == "call_function" and not spec(n).block]
    assert {spec(n).fqn.split(".")[0] for n in outside} >= {"wte", "wpe", "lm_head"}


def test_a_cut_inside_a_block_records_its_two_parts_one_per_stage(samples):
    layout = Layout(tp=2, pp=2)
    result = compile_program(samples / "llama.py", layout,
                             plan={"split_before": ["model.layers.1.mlp"]})
    units = _units(result)
    assert sorted(units) == [(0, "model.layers.0"), (0, "model.layers.1"), (1, "model.layers.1"),
                             (1, "model.layers.2"), (1, "model.layers.3")]
    first, second = units[(0, "model.layers.1")], units[(1, "model.layers.1")]
    assert {spec(n).stage for n in first.nodes} == {0} and {spec(n).stage for n in second.nodes} == {1}
    assert not any(under(spec(n).fqn, "model.layers.1.mlp") for n in first.nodes)
    assert any(under(spec(n).fqn, "model.layers.1.mlp") for n in second.nodes)
    assert not any(under(spec(n).fqn, "model.layers.1.self_attn") for n in second.nodes)


def test_without_repeated_blocks_nothing_is_recorded(models):
    result = compile_program(models / "mlp.py", Layout(tp=2))
    assert "blocks" in result.ctx.passes_run
    assert all(spec(n).block == "" for n in result.gm.graph.nodes)


def _in(gm, fqn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and spec(n).fqn.startswith(fqn)]


@pytest.mark.parametrize(("change", "message"), [
    (lambda gm: update_spec(_in(gm, "lm_head")[0], block="blocks.3"), r"\w+ \(lm_head\) runs in block blocks.3, "
                                                                       r"outside its module"),
    (lambda gm: update_spec(_in(gm, "blocks.3")[3], block=""), r"\w+ runs in block blocks.3, apart from the "
                                                                r"block's other nodes"),
], ids=["outside its module", "in two pieces"])
def test_a_block_recorded_outside_its_module_or_in_pieces_breaks_the_contract(samples, change, message):
    blocks = registered("blocks")

    def broken_blocks_pass(gm, ctx):
        gm = blocks.run(gm, ctx)
        change(gm)
        return gm

    passes = [dataclasses.replace(p, run=broken_blocks_pass) if p is blocks else p for p in PASSES]
    with mock.patch.object(compiler, "PASSES", passes), pytest.raises(
            ContractError, match=r"broken_blocks_pass ensures 'repeated blocks recorded.*', but after it " + message):
        compile_program(samples / "gpt.py", Layout(tp=2))


@pytest.mark.slow  # compiles and plans the sample GPT: 5 s alone
def test_codegen_and_the_plan_read_the_blocks_the_graph_records(samples):
    """A blocks pass that records no block: the rank file calls no submodule, and the plan finds no block to
    recompute (before, both searched the graph for blocks themselves and found them whatever the passes said)."""
    from fxshard.cost.costs import plan_costs

    def no_blocks_pass(gm, ctx):
        return gm

    passes = [dataclasses.replace(p, run=no_blocks_pass) if p.name == "blocks" else p for p in PASSES]
    with mock.patch.object(compiler, "PASSES", passes):
        code = compile_model(samples / "gpt.py", Layout(tp=2)).sources["rank_pp0_tp0.py"]
        flat = plan_costs(samples / "gpt.py", Layout(tp=2))
    assert "self.blocks_0(" not in code and "a repeated block" not in code
    assert list(flat.recompute_summary()["peaks"]) == ["none"]  # with the real pass: none, selective, full
