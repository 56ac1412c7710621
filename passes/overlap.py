"""Overlap in backward: a ``copy_to`` (or an sp ``gather_to``) and the column-parallel linears that read it, fused.

A column-parallel linear's input enters split compute through ``copy_to``: identity forward, all-reduce of
the gradient backward.  As separate ops, autograd computes the linears' input and weight gradients, and only
then does the ``copy_to`` all-reduce the input gradient.  Fused (``rt.copy_to_linears``, Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication``, :mod:`fxshard.runtime.collectives`), backward computes
the input gradient first, starts its all-reduce, computes the weight gradients while it runs and waits for it
last: the same bytes and values, the all-reduce hidden behind the weight gradients.

Each ``copy_to`` whose every user is such a linear becomes one node, and each linear the fused op's output at
its position, so the plan and the checks read the op the rank file runs::

    copy_to_linears_3 = rt.copy_to_linears(x, self.tp, weights=(wq, wk, wv), biases=(bq, bk, bv))
    linear_3 = copy_to_linears_3[0]

Under ``--sp`` the column-parallel input is a ``gather_to`` (all-gather of the sp shard) rather than a ``copy_to``.
Its linears become one ``rt.linears_regathered`` beside it: the gather stays, and the linears save the shard it read
rather than the gathered tensor (1/tp of the bytes), gathering it again in backward while the input gradient
computes (Megatron-LM's way under sequence parallelism; the plan counts the second all-gather and what it keeps)::

    gather_to = rt.gather_to(mul_1, self.tp, dim=1)
    linears_regathered = rt.linears_regathered(gather_to, self.tp, shard=mul_1, dim=1, weights=(wq, wk, wv), ...)

Under ``--fp8`` (passes/fp8.py, which runs first) the column-parallel linears are
``rt.fp8_linear_tp(..., split="out")``; those reading an sp ``gather_to``, all of one recipe, become one
``rt.fp8_linears_regathered``, which keeps the shard likewise and all-reduces the amaxes of all its products at once,
forward and backward (a ``copy_to``'s fp8 linears stay unfused: they keep the one input they share either way)::

    fp8_linears_regathered = rt.fp8_linears_regathered(gather_to, self.tp, shard=mul_1, dim=1, weights=(wq, wk, wv),
                                                       biases=(None, None, None), recipe="tensorwise")

Under ``--cp`` the amaxes span cp's tokens too: the fused call all-reduces them over ``amax_group=self.cp_tp`` and
gathers over ``self.tp``.

A linear qualifies when it takes the ``copy_to`` as its input and runs in the same generated class (the same
pipeline stage, and the same block submodule or outside every block: :mod:`fxshard.ir.blocks`), with weights
and biases that class's own parameters.  The pass runs unless ``--no-overlap``, and not under the zero-bubble
schedule, whose split backward would run the fused backward in both of its passes.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from fxshard.ir.blocks import Body, block_units, bodies, held_state, unit_of
from fxshard.ir.context import CompileContext, Group, spec, update_spec
from fxshard.ir.layout import TP
from fxshard.runtime import collectives as rtc
from fxshard.runtime import fp8 as rt_fp8

aten = torch.ops.aten


def overlap_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    for body in bodies(gm, ctx):
        for node, linears in _fusible(body).items():
            _fuse(gm, node, linears)
    gm.recompile()
    return gm


def _fusible(body: Body) -> dict[fx.Node, list[fx.Node]]:
    """Each ``copy_to`` of ``body`` that fuses with its users, with those linears in the class's order."""
    units = block_units(body.nodes, body.state, body.keep, body.apart)
    where, held = unit_of(units), held_state(body, units)
    position = {n: i for i, n in enumerate(body.nodes)}
    found = {}
    for node in body.nodes:
        if not (node.target is rtc.copy_to or _sp_gather(node)) or not node.users or node in body.apart:
            continue
        cls = where.get(node)
        if not all(u in position and u not in body.apart and where.get(u) is cls for u in node.users):
            continue
        recipes = {_fp8_of(u, node, held[cls]) for u in node.users}  # under --sp, fp8 linears of one recipe
        if all(_linear_of(u, node, held[cls]) for u in node.users) or (
                node.target is rtc.gather_to and len(recipes) == 1 and None not in recipes):
            found[node] = sorted(node.users, key=position.__getitem__)
    return found


def _sp_gather(node: fx.Node) -> bool:
    """Whether ``node`` is sequence parallelism's ``gather_to`` over tp (one block of the gathered dimension)."""
    return (node.target is rtc.gather_to and set(node.kwargs) <= {"dim"} and len(node.args) == 2
            and isinstance(node.args[1], Group) and node.args[1].axis == TP)


def _linear_of(user: fx.Node, x: fx.Node, state: set[fx.Node]) -> bool:
    """Whether ``user`` is ``linear(x, weight[, bias])`` with weight and bias among ``state``."""
    return (user.op == "call_function" and user.target is aten.linear.default and not user.kwargs
            and user.args[0] is x and all(a in state for a in user.args[1:] if a is not None))


def _fp8_of(user: fx.Node, x: fx.Node, state: set[fx.Node]) -> str | None:
    """The recipe of ``user`` where it is ``fp8_linear_tp(x, tp, weight=, bias=, split="out")`` (passes/fp8.py: a
    column-parallel fp8 linear) with weight and bias among ``state``, else None."""
    if user.op != "call_function" or user.target is not rt_fp8.fp8_linear_tp or user.args[0] is not x:
        return None
    kw = user.kwargs
    if kw.get("split") != "out" or not all(a in state for a in (kw["weight"], kw.get("bias")) if a is not None):
        return None
    return kw["recipe"]


def _fuse(gm: fx.GraphModule, node: fx.Node, linears: list[fx.Node]) -> None:
    """Read ``node``'s linears through one fused op, each linear its output: a copy_to is replaced by one
    ``rt.copy_to_linears``; an sp gather_to stays, its linears one ``rt.linears_regathered`` beside it, which keeps
    the gather's input (the sp shard) for backward rather than its output."""
    x, group = node.args
    recipe = linears[0].kwargs["recipe"] if linears[0].target is rt_fp8.fp8_linear_tp else None
    if recipe is None:
        weights = tuple(n.args[1] for n in linears)
        biases = tuple(n.args[2] if len(n.args) > 2 else None for n in linears)
    else:
        weights, biases = (tuple(n.kwargs[k] for n in linears) for k in ("weight", "bias"))
    last = {"recipe": recipe} if recipe is not None else {}
    amaxes = linears[0].args[1] if recipe is not None else None  # passes/fp8.py's amax group: tp, or cp_tp
    if amaxes is not None and amaxes != group:
        last["amax_group"] = amaxes
    if node.target is rtc.copy_to:
        function, args, first = rtc.copy_to_linears, (x, group), {}
        name, where = node.name.replace("copy_to", "copy_to_linears", 1), gm.graph.inserting_before(node)
    else:
        function = rt_fp8.fp8_linears_regathered if recipe is not None else rtc.linears_regathered
        args, first = (node, group), {"shard": x, "dim": node.kwargs["dim"]}
        name, where = function.__name__, gm.graph.inserting_after(node)
    collective = function.__name__
    with where:
        fused = gm.graph.create_node("call_function", function, args,
                                     first | {"weights": weights, "biases": biases} | last, name=name)
    fused.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
    fused.meta["val"] = tuple(n.meta["val"] for n in linears)
    fused.meta["fxshard"] = dataclasses.replace(spec(node), collective=collective,
                                                placement=tuple(spec(n).placement for n in linears))
    for i, linear in enumerate(linears):  # in place: each keeps its name, position and facts
        linear.target = operator.getitem
        linear.args, linear.kwargs = (fused, i), {}
        update_spec(linear, inputs=(), collective=None)  # as for any getitem: it reads no tensor (a tuple)
    if node.target is rtc.copy_to:
        gm.graph.erase_node(node)
