"""Expert parallelism (``--ep N``): each mixture-of-experts layer's experts split over N ranks of dp.

A transformers 5 MoE layer stores its experts stacked and runs them as two grouped matmuls over the routed rows
sorted by expert: the pattern :mod:`fxshard.ir.experts` recognizes (its docstring shows the captured lines).  This
pass keeps every one of those lines (the router, top-k, the sort, the activation, the weighting and the combine are
the model's own) and puts the exchange of :mod:`fxshard.runtime.experts` around the row-wise part (its docstring
shows the four calls a rank file makes): the rows go to the rank of their expert, the model's grouped matmuls run
this rank's E/N experts on them, and the rows come back in the sender's order.

Each row meets the same expert weights and the same ops as on one device, so the result is exact (dropless:
no row is ever dropped).  What cannot be recognized this way is refused, naming the module.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.errors import LayoutError
from fxshard.ir.context import EP, CompileContext, Group, NodeSpec, spec
from fxshard.ir.experts import grouped_mms, not_row_wise, offsets, weight_param
from fxshard.ir.placement import Replicate
from fxshard.runtime import experts as rte
from fxshard.runtime.experts import expert_offsets

aten = torch.ops.aten
R = Replicate()
GROUP = Group(EP)


def _layers(gm: fx.GraphModule, ctx: CompileContext) -> dict[str, list[fx.Node]]:
    """The grouped matmuls of each MoE experts module, by module FQN, in graph order."""
    return grouped_mms(gm, lambda node: spec(node).fqn)


def expert_parallel_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    ep = ctx.layout.ep
    if ep == 1:
        return gm
    layers = _layers(gm, ctx)
    if not layers:
        stacked = sorted(s.fqn for s in ctx.program.state if s.kind == "parameter" and "expert" in s.fqn)
        found = (f"expert parameters {stacked[:3]} not run by a grouped matmul (an expert loop, or "
                 "experts_implementation other than grouped_mm)") if stacked else "no mixture-of-experts layer"
        raise LayoutError(f"--ep {ep}: {type(ctx.program.model).__name__}: expected mixture-of-experts layers "
                          "whose stacked experts run as grouped matmuls (transformers 5 experts, "
                          f"experts_implementation='grouped_mm'); found {found}; drop --ep")
    for fqn, mms in layers.items():
        _rewrite(gm, ctx, fqn, mms)
    gm.recompile()
    return gm


def _rewrite(gm: fx.GraphModule, ctx: CompileContext, fqn: str, mms: list[fx.Node]) -> None:
    ep, state = ctx.layout.ep, ctx.program.state_by_name()
    where = f"--ep {ep}: {fqn or 'model'}"
    if len(mms) != 2:
        raise LayoutError(f"{where}: expected two grouped matmuls (gate/up, then down) in the experts module, found "
                          f"{len(mms)}; this expert layout is not supported under --ep; drop --ep")
    first, second = mms
    offs = offsets(first)
    if offsets(second) is not offs or set(offs.users) != {first, second}:
        raise LayoutError(f"{where}: expected both grouped matmuls to take the same expert offsets and nothing else "
                          f"to read them; found {offs.name} used by {sorted(u.name for u in offs.users)}; drop --ep")
    _check_row_wise(first, second, where)
    experts = offs.meta["val"].shape[0]
    if experts % ep:
        ok = [e for e in range(1, experts + 1) if experts % e == 0]
        raise LayoutError(f"{where}: {experts} experts cannot be split over ep={ep}; use --ep in {ok}")
    for mm in mms:
        param, chain = weight_param(mm.args[1], ctx.params)
        if param is None or param.meta["val"].shape[0] != experts:
            raise LayoutError(f"{where}: expected the grouped matmul {mm.name}'s weight to be a stacked expert "
                              f"parameter [{experts}, ...] (transposed or cast at most); found {mm.args[1].name}; "
                              "drop --ep")
        ctx.expert_params[state[param.name].fqn] = experts
        for n in (param, *chain):  # this rank's E/ep experts from here on
            val = n.meta["val"]
            n.meta["val"] = val.new_empty((experts // ep, *val.shape[1:]))
    with gm.graph.inserting_before(first):
        counts = _node(gm, rte.exchange_counts, (offs, GROUP), first, "exchange_counts")
        counts.meta["val"] = offs.meta["val"].new_empty((ep, experts // ep), dtype=torch.int64)
        rows = _node(gm, rte.all_to_all_dispatch, (first.args[0], GROUP, offs, counts), first, "all_to_all_dispatch")
        rows.meta["val"] = first.args[0].meta["val"]
        local = _node(gm, expert_offsets, (counts,), first, "")
        local.meta["val"] = offs.meta["val"].new_empty((experts // ep,), dtype=torch.int32)
    for mm in mms:
        mm.args = fx.node.map_arg(mm.args, lambda a: local if a is offs else a)
        mm.kwargs = fx.node.map_arg(mm.kwargs, lambda a: local if a is offs else a)
    first.args = (rows, *first.args[1:])
    with gm.graph.inserting_after(second):
        back = _node(gm, rte.all_to_all_combine, (second, GROUP, offs, counts), second, "all_to_all_combine")
        back.meta["val"] = second.meta["val"]
    second.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)


def _check_row_wise(first: fx.Node, second: fx.Node, where: str) -> None:
    """Every op from the first grouped matmul to the second must act on each row alone: the rows a rank
    computes are another set than on one device, in another order."""
    why = not_row_wise(first, second)
    if why is not None:
        raise LayoutError(f"{where}: {why}; expert parallelism cannot reorder its rows exactly; drop --ep")


def _node(gm: fx.GraphModule, target, args, owner: fx.Node, collective: str) -> fx.Node:
    node = gm.graph.call_function(target, args)
    node.meta["nn_module_stack"] = owner.meta.get("nn_module_stack", {})
    if "stack_trace" in owner.meta:
        node.meta["stack_trace"] = owner.meta["stack_trace"]
    inputs = None if collective else (R,)
    node.meta["fxshard"] = NodeSpec(R, spec(owner).fqn, "expert-parallel", collective, inputs,
                                    spec(owner).segment, spec(owner).stage)
    return node
