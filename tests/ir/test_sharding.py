"""Tier 1: what propagation decides for one op, and what the tensor-parallel pass makes of it (no process group).

``test_sharding_rules.py`` runs the same cases on real ranks; here every case is only compiled at tp=2, so
``make test-fast`` sees a rule that decides otherwise than its case says, or a rewrite that fails to compile.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx as fx
from sharding_cases import CASES, Case
from single_op import check_decision, compile_case

from fxshard.compiler import compile_program
from fxshard.errors import ShardingError
from fxshard.ir.context import Layout
from fxshard.ir.placement import Partial, Replicate, Shard
from fxshard.ir.sharding import argument, propagate, set_argument

aten = torch.ops.aten
R = Replicate()
BY_KEY = {c.key: c for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c.key for c in CASES])
def test_every_case_compiles_and_decides_as_stated(case: Case):
    if case.expect == "refused":
        with pytest.raises(ShardingError, match="in place"):
            compile_case(case, 2)
        return
    check_decision(case, compile_case(case, 2))


def _graph(build) -> tuple[fx.GraphModule, fx.Node]:
    """A graph of one placeholder ``x`` [2, 4, 8] and the node ``build(graph, x)`` makes (with its value)."""
    graph = fx.Graph()
    a = graph.placeholder("x")
    a.meta["val"] = torch.empty(2, 4, 8)
    node = build(graph, a)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    node.meta["val"] = node.target(*args, **kwargs)
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph), node


@pytest.mark.parametrize("args,kwargs", [((-1,), {}), ((), {"dim": -1})], ids=["positional", "keyword"])
def test_argument_reads_an_argument_however_it_was_passed(args, kwargs):
    gm, node = _graph(lambda g, a: g.call_function(aten.sum.dim_IntList, (a, *args), kwargs))
    assert argument(node, "dim") == -1
    assert argument(node, "keepdim") is False  # the schema's default
    assert argument(node, "no_such_argument", "absent") == "absent"
    set_argument(node, "dim", [0])
    assert argument(node, "dim") == [0] and (node.args[1:] == ([0],) if args else node.kwargs == {"dim": [0]})


@pytest.mark.parametrize("build,expected", [
    (lambda g, a: g.call_function(aten.transpose.int, (a,), {"dim0": 0, "dim1": 2}), Shard(0)),
    (lambda g, a: g.call_function(aten.sum.dim_IntList, (a,), {"dim": [0], "keepdim": True}), Shard(2)),
    (lambda g, a: g.call_function(aten.sum.dim_IntList, (a,), {"dim": [-1]}), Partial()),
    (lambda g, a: g.call_function(aten.amax.default, (a,), {"dim": [-1]}), None),
    (lambda g, a: g.call_function(aten.softmax.int, (a,), {"dim": 2}), None),
    (lambda g, a: g.call_function(aten.softmax.int, (a,), {"dim": 0}), Shard(2)),
], ids=["transpose", "sum-keepdim", "sum-split-dim", "amax-split-dim", "softmax-split-dim", "softmax"])
def test_rules_honor_keyword_arguments(build, expected):
    gm, node = _graph(build)
    x_node = next(iter(gm.graph.nodes))
    prop = propagate(gm, {x_node: Shard(2)})
    if expected is None:
        assert node in prop.fallbacks and prop.decisions[node].inputs == (R,)
    else:
        assert node not in prop.fallbacks and prop.decisions[node].out == expected


def _rank0(key: str) -> str:
    return compile_case(BY_KEY[key], 2).sources[0]


def test_unflatten_sizes_are_those_of_a_rank():
    assert "aten.unflatten.int(self.a0, 1, [2, 4])" in _rank0("unflatten")
    assert "aten.unflatten.int(self.a0, -1, [2, 4])" in _rank0("unflatten-negative")
    assert "aten.unflatten.int(self.a0, 0, [2, 2])" in _rank0("unflatten-split-dim")
    assert "aten.unflatten.int(self.a0, dim=1, sizes=[2, 4])" in _rank0("unflatten-keyword")


def test_shape_constants_passed_by_keyword_are_localized():
    assert "size=[4, 2, 4]" in _rank0("view-keyword")
    assert "split_size=2" in _rank0("split-packed-keyword")
    assert "split_sizes=[2, 2, 2]" in _rank0("split-sizes-keyword")


def test_a_squeeze_keeps_a_split_whose_parts_have_size_one():
    # [4, 2] split over 2 ranks: each holds [4, 1], which squeeze() would make [4]; the model's keeps [4, 2]
    assert "aten.squeeze.dims(self.a0, [])" in _rank0("squeeze-all-tp-sized")
    assert "aten.squeeze.dims(self.a0, [])" in _rank0("squeeze-split-dim")
    assert "aten.squeeze.default(self.a0)" in _rank0("squeeze-all")  # parts of size 4: left as written


@pytest.mark.parametrize("key", ["zeros-like-partial", "ones-like-partial", "full-like-partial"])
def test_a_factory_shaped_like_a_partial_sum_is_whole_and_reduces_nothing(key):
    compiled = compile_case(BY_KEY[key], 2)
    [(_, decision, _)] = compiled.decisions
    assert decision.out == R and decision.inputs == (Partial(),)
    assert "rt.all_reduce(" not in compiled.sources[0]


def test_addmm_row_split_keeps_its_bias_after_the_reduction_only_at_beta_alpha_one():
    code = _rank0("addmm-rowwise-full-bias")
    assert "aten.mm.default(" in code and "rt.all_reduce(" in code and "aten.addmm" not in code
    for key in ("addmm-rowwise-beta", "addmm-rowwise-alpha"):
        code = _rank0(key)
        assert "aten.addmm.default(" in code and "rt.all_reduce(" not in code and "rt.all_gather(" in code


@pytest.mark.parametrize("key,hint", [
    ("embedding-vocab-max-norm", "nn.Embedding's max_norm renormalizes the looked-up rows"),
], ids=["max-norm"])
def test_an_in_place_write_on_a_split_tensor_is_refused_naming_the_op(key, hint):
    with pytest.raises(ShardingError, match="in place") as e:
        compile_case(BY_KEY[key], 2)
    assert hint in str(e.value)


def test_an_in_place_write_on_a_whole_tensor_runs_whole_on_it():
    compiled = compile_case(BY_KEY["add-in-place-buffer-whole"], 2)
    code = compiled.sources[0]
    assert "rt.all_gather(self.a1, self.tp, dim=0" in code and "aten.add_.Tensor(self.a0, all_gather)" in code


def test_a_forward_writing_a_parameter_is_refused_under_data_parallelism(tmp_path):
    model = tmp_path / "max_norm.py"
    model.write_text((Path(__file__).resolve().parents[1] / "models" / "padded_embedding.py").read_text()
                     .replace("nn.Embedding(64, 16, padding_idx=1)", "nn.Embedding(64, 16, max_norm=1.0)"))
    with pytest.raises(ShardingError, match=r"tok\.weight in place .*max_norm.* under dp=2"):
        compile_program(model, Layout(dp=2))
    compile_program(model, Layout(dp=1))  # one replica: it writes every row it looks up, as one device

