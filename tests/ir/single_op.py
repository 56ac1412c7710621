"""Compile one op as a model with the placements a case gives its inputs, run it on every rank, compare.

The driver of ``test_sharding_rules.py`` (see its docstring), and of the single-process tests that look at
what the compiler made of one op (``compile_case`` alone)::

    compiled = compile_case(Case("gelu", F.gelu, (torch.randn(4, 8),), (Shard(1),), aten.gelu), tp=2)
    compiled.sources[0]  # rank 0's generated file
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import torch
import torch.fx as fx
from fxshard.passes.tensor_parallel import apply_propagation
from sharding_cases import Case
from torch.utils import _pytree as pytree

from fxshard import compiler
from fxshard.capture.modelfile import ModelFile
from fxshard.capture.program import _WithLoss, capture
from fxshard.ir.context import Layout
from fxshard.ir.placement import Partial, Replicate, Shard, SliceSpec, assemble
from fxshard.ir.sharding import propagate

R = Replicate()
TOL = dict(rtol=1e-6, atol=1e-5)  # fp32 values of order 1: a split only reorders sums (of up to 64 terms)


class _Op(torch.nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.fn, self.n, self.batch = case.fn, len(case.inputs), sorted(case.batch)
        for i, t in enumerate(case.inputs):
            if i in case.batch:
                continue
            if t.is_floating_point() and i not in case.frozen:
                self.register_parameter(f"a{i}", torch.nn.Parameter(t.clone()))
            else:
                self.register_buffer(f"a{i}", t.clone())

    def forward(self, *batch):
        given = dict(zip(self.batch, batch, strict=True))
        return self.fn(*[given[i] if i in given else getattr(self, f"a{i}") for i in range(self.n)])


def _loss(out, inputs):
    return out if isinstance(out, torch.Tensor) else out[0]


def _model_file(model: _Op, batch: tuple) -> ModelFile:
    return ModelFile(path=Path(__file__), make_model=lambda: model, make_inputs=lambda: batch, loss_fn=_loss,
                     module=None)


def _as_keywords(gm: fx.GraphModule) -> None:
    """Every ATen call's arguments after its leading tensors passed by name (as a hand-built graph may)."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        first = next((i for i, a in enumerate(node.args) if not isinstance(a, fx.Node)), len(node.args))
        names = [a.name for a in schema.arguments]
        node.kwargs = {**dict(zip(names[first:], node.args[first:], strict=False)), **node.kwargs}
        node.args = node.args[:first]
    gm.recompile()


@dataclasses.dataclass
class Compiled:
    sources: list[str]  # per tp rank
    states: list[dict]  # per tp rank: attribute -> local tensor
    slices: dict  # attribute -> (input index, SliceSpec per rank)
    batch: tuple
    decisions: list  # (node name, Decision, fell back) of the nodes of the case's op
    notes: list[str]
    reference: tuple  # (outputs, gradients by input index, inputs after the forward by index)
    cotangents: list


def compile_case(case: Case, tp: int) -> Compiled:
    """Capture ``case`` as a model, compile it at ``tp`` with the case's placements, generate its rank files."""
    model = _Op(case)
    batch = tuple(case.inputs[i].clone() for i in sorted(case.batch))
    mf = _model_file(model, batch)
    program = capture(mf, model=model, inputs=batch)
    names = {s.fqn: s.name for s in program.state}
    inputs = iter(i.name for i in program.inputs)
    placeholder = {i: next(inputs) if i in case.batch else names[f"a{i}"] for i in range(len(case.inputs))}
    seen = []

    def tensor_parallel_pass(gm, ctx):
        if case.keywords:
            _as_keywords(gm)
        nodes = {n.name: n for n in gm.graph.nodes}
        weights = {nodes[placeholder[i]]: p for i, p in enumerate(case.placements) if p != R}
        prop = propagate(gm, weights)
        for n in gm.graph.nodes:
            if getattr(n.target, "overloadpacket", n.target) is case.op:
                seen.append((n.name, prop.decisions[n], n in prop.fallbacks))
        apply_propagation(gm, prop, ctx)
        return gm

    # the compiler's own pass list with the stand-in for tensor parallelism (every other pass as it runs), held to
    # the real pass's contract by the driver
    passes = [dataclasses.replace(p, run=tensor_parallel_pass) if p.name == "tensor_parallel" else p
              for p in compiler.PASSES]
    with mock.patch.object(compiler, "PASSES", passes):
        result = compiler.compile_program(mf, Layout(tp=tp), program=program)
    sources, manifest, shards = compiler._generate(result, mf, 0)
    slices = {}
    for entry in manifest.ranks:
        for attr, t in entry.tensors.items():  # the state of input i is model attribute a<i>
            slices.setdefault(attr, (int(t.source.removeprefix("a")), []))[1].append(t.slice)
    states = [shards[e.weights] for e in manifest.ranks]
    reference, cotangents = _reference(case)
    return Compiled([sources[e.file] for e in manifest.ranks], states, slices, batch, seen, result.ctx.notes,
                    reference, cotangents)


def _reference(case: Case):
    """The op on one device: outputs as the captured program returns them, and what backward gives."""
    model = _Op(case)
    step = _WithLoss(model, _loss, True)
    loss, out = step(*[case.inputs[i].clone() for i in sorted(case.batch)])
    outputs = [loss] + [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    g = torch.Generator().manual_seed(7)
    cotangents = [torch.randn(o.shape, generator=g) if o.is_floating_point() else None for o in outputs]
    _backward(outputs, cotangents)
    grads = {i: getattr(model, f"a{i}").grad for i in range(len(case.inputs))
             if isinstance(getattr(model, f"a{i}", None), torch.nn.Parameter)}
    grads = {i: g.to_dense() if g is not None and g.is_sparse else g for i, g in grads.items()}
    after = {i: getattr(model, f"a{i}").detach().clone() for i in range(len(case.inputs)) if i not in case.batch}
    return ([o.detach() for o in outputs], grads, after), cotangents


def _backward(outputs, cotangents) -> None:
    terms = [(o * c).sum() for o, c in zip(outputs, cotangents, strict=True) if c is not None and o.requires_grad]
    if terms:
        sum(terms).backward()


def run_rank(sources: list[str], states: list[dict], batch: tuple, cotangents: list):
    """On each rank of the spawned group: its generated ``RankModule``, forward and backward."""
    import torch.distributed as dist

    return _run(dist.get_rank(), dist.group.WORLD, sources, states, batch, cotangents)


def run_thread(group, sources: list[str], states: list[dict], batch: tuple, cotangents: list):
    """On each thread of a ``threaded_group.ThreadedGroup``: the same as :func:`run_rank`."""
    return _run(group.rank(), group, sources, states, batch, cotangents)


def _run(rank: int, group, sources: list[str], states: list[dict], batch: tuple, cotangents: list):
    scope: dict = {}
    exec(compile(sources[rank], f"rank_tp{rank}.py", "exec"), scope)
    module = scope["RankModule"]({"tp": group})
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    with torch.no_grad():
        for name, value in states[rank].items():
            own[name].copy_(value)
    outputs = list(module(*batch))
    _backward(outputs, cotangents)
    grads = {name: p.grad.to_dense() if p.grad is not None and p.grad.is_sparse else p.grad
             for name, p in module.named_parameters()}
    after = {name: t.detach().clone() for name, t in own.items()}
    return [o.detach() for o in outputs], grads, after


# ---------------------------------------------------------------- checking one case


def check_case(case: Case, compiled: Compiled, per_rank: list) -> None:
    """The decision as ``case.expect`` says, and every rank's outputs, gradients and state as on one device."""
    check_decision(case, compiled)
    outputs, grads, after = compiled.reference
    for rank, (got, _, _) in enumerate(per_rank):
        assert len(got) == len(outputs), f"rank {rank}: {len(got)} outputs, expected {len(outputs)}"
        for k, (g, want) in enumerate(zip(got, outputs, strict=True)):
            torch.testing.assert_close(g, want, **TOL, msg=lambda m, k=k, r=rank: f"output {k}, rank {r}: {m}")
    for attr, (i, specs) in compiled.slices.items():
        _check_state(f"input {i}'s gradient", grads.get(i), specs, [g.get(attr) for _, g, _ in per_rank])
        _check_state(f"input {i} after the forward", after[i], specs, [a.get(attr) for _, _, a in per_rank])


def _check_state(what: str, want, specs: list[SliceSpec], found: list) -> None:
    """``found`` (one tensor per rank, its slice ``specs[rank]``) is ``want``: whole on each rank, or assembled."""
    if want is None or all(f is None for f in found):
        one = want if want is not None else next((f for f in found if f is not None), None)
        assert one is None or not one.any(), f"{what}: on one side only"
        return
    if specs[0].parts == 1:
        for rank, got in enumerate(found):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, r=rank: f"{what}, rank {r}: {m}")
    else:
        got = assemble(list(zip(specs, found, strict=True)), tuple(want.shape))
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def check_decision(case: Case, compiled: Compiled) -> None:
    """What the rule decided for the case's op: a split, a fallback (noted), or whole compute."""
    assert compiled.decisions, f"no {case.op} node in the captured graph"
    for name, d, fell_back in compiled.decisions:
        placements = (*(d.out if isinstance(d.out, tuple) else (d.out,)), *d.inputs)
        split = any(isinstance(p, (Shard, Partial)) for p in placements)
        if case.expect == "split":
            assert split and not fell_back, f"{name}: expected a split decision, got {d}"
        elif case.expect == "declined":
            assert fell_back and not split, f"{name}: expected the rule to decline, got {d}"
            assert any("has no sharding rule" in n for n in compiled.notes), compiled.notes
        elif case.expect == "whole":
            assert not fell_back and not split, f"{name}: expected whole compute, got {d}"
