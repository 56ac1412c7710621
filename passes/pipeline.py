"""Cut the flat graph into pipeline stages: record in every node's spec the stage that computes it.

Runs after the tensor-parallel passes, on the graph with its collectives, so a stage is a
contiguous run of per-rank nodes (graph order is execution order).  Where to cut: markers in the
model, ``split_before`` in the plan, or a balance of the repeated blocks (:mod:`fxshard.ir.cut`).
Each node computing the loss gets ``NodeSpec.stage``; what the model's other outputs alone need runs
nowhere, since the last stage returns the loss alone.  The cut itself (its source, what each stage holds,
the cost table) goes to ``ctx.pipeline``.  Which values cross stages, are recomputed, or are weights
held by several stages follows from the graph and is derived by :mod:`fxshard.ir.stages` when needed.
"""

from __future__ import annotations

import bisect
import math

import torch
import torch.fx as fx

from fxshard.errors import LayoutError, PlanError
from fxshard.graph import loss_cone, node_fqn
from fxshard.ir.context import CompileContext, spec, update_spec
from fxshard.ir.cut import Blocks, CutPlan, balance, block_spans, find_blocks, node_flops, segments, under
from fxshard.ir.placement import local_shape
from fxshard.ir.stages import recomputable


def pipeline_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    layout = ctx.layout
    if layout.pp == 1:
        return gm
    state_names = ctx.program.state_by_name()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out_node.args[0][0]
    if not isinstance(loss, fx.Node) or loss.op != "call_function":
        raise LayoutError("the loss is not computed by the model; pipeline parallelism needs a loss to train")
    live = loss_cone(gm)
    compute = [n for n in gm.graph.nodes if n.op == "call_function" and n in live]
    cut = _choose_cut(gm, compute, ctx)
    own: list[list[fx.Node]] = [[] for _ in range(layout.num_stages)]
    for i, n in enumerate(compute):
        own[bisect.bisect_right(cut.starts, i) - 1].append(n)
    cache: dict[fx.Node, list[fx.Node] | None] = {}
    for s, nodes in enumerate(own):
        if all(recomputable(n, state_names, cache) is not None for n in nodes):
            raise PlanError(f"{cut.source}: the cuts leave pipeline stage {s} empty (no computation on the "
                            f"inputs or weights{', only constants' if nodes else ''}); move or remove a cut")
        for n in nodes:
            update_spec(n, stage=s)
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name not in state_names and n.users \
                and not isinstance(n.meta.get("val"), torch.Tensor):
            raise LayoutError(f"input {n.name} is not a tensor ({n.meta.get('val')!r}) but the model uses it; "
                              "pipeline stages exchange tensors only: make it a tensor or a constant of the model")
    ctx.pipeline = cut
    return gm


# ---------------------------------------------------------------- where to cut

def _choose_cut(gm: fx.GraphModule, compute: list[fx.Node], ctx: CompileContext) -> CutPlan:
    S = ctx.layout.num_stages
    what = f"--pp {ctx.layout.pp}" + (f" x {ctx.layout.stages_per_rank} virtual stages" if S > ctx.layout.pp else "")
    blocks = find_blocks(ctx.program.module_types, gm)
    markers = max((spec(n).segment or 0 for n in gm.graph.nodes), default=0)
    costs = _param_costs(compute, ctx)
    if markers:
        if markers != S - 1:
            raise PlanError(f"the model marks {markers} pipeline cut(s) with fxshard.pipeline_split(); {what} needs "
                            f"{S - 1} (one fewer than the {S} stages); add or remove markers, or change --pp")
        seg = _segments_of(compute)
        starts = [0] + [next((i for i, g in enumerate(seg) if g >= k), len(compute)) for k in range(1, S)]
        _check_starts(starts, len(compute), "fxshard.pipeline_split() markers",
                      [f"marker {k}" for k in range(1, S)])
        return _describe(CutPlan("markers", starts, []), compute, blocks, ctx, costs)
    if ctx.split_before:
        names = list(ctx.split_before)
        if len(names) != S - 1:
            raise PlanError(f"split_before names {len(names)} cut(s) {names}; {what} needs {S - 1}")
        found = []
        for fqn in names:
            i = next((i for i, n in enumerate(compute) if under(node_fqn(n), fqn)), None)
            if i is None:
                hint = f" (the repeated blocks are {blocks.names[0]} .. {blocks.names[-1]})" if blocks else ""
                raise PlanError(f"split_before: {fqn!r} names no module that computes anything{hint}; "
                                "use a module path from the model, e.g. model.layers.8")
            found.append((i, fqn))
        found.sort()
        starts = [0] + [i for i, _ in found]
        _check_starts(starts, len(compute), "split_before", [f"before {f}" for _, f in found])
        return _describe(CutPlan("split_before", starts, []), compute, blocks, ctx, costs)
    if blocks is None:
        raise PlanError(f"{what}: the model has no repeated blocks (a ModuleList of layers) to cut between; "
                        "mark the cuts with fxshard.pipeline_split() in forward, or pass split_before")
    if len(blocks) < S:
        raise LayoutError(f"{what} needs {S} pipeline stages but the model has {len(blocks)} repeated blocks "
                          f"({blocks.names[0]} .. {blocks.names[-1]}, {blocks.cls}); a stage holds at least one "
                          f"block: use --pp <= {len(blocks)}" + (" or fewer --virtual-stages" if S > ctx.layout.pp
                                                                  else ""))
    segs = segments(compute, blocks, *costs)
    sizes = balance([s.cost for s in segs[1:-1]], S, segs[0].cost, segs[-1].cost)
    starts, k = [0], 1
    for size in sizes[:-1]:
        k += size
        starts.append(segs[k].first)
    return _describe(CutPlan("auto", starts, []), compute, blocks, ctx, costs)


def _segments_of(compute: list[fx.Node]) -> list[int]:
    """Each compute node's marker segment; nodes the passes inserted take the next labelled node's."""
    seg = [spec(n).segment for n in compute]
    nxt = None
    for i in range(len(seg) - 1, -1, -1):
        if seg[i] is None:
            seg[i] = nxt if nxt is not None else 0
        nxt = seg[i]
    return seg


def _check_starts(starts: list[int], n: int, source: str, what: list[str]) -> None:
    for s in range(1, len(starts)):
        end = starts[s + 1] if s + 1 < len(starts) else n
        if starts[s] <= starts[s - 1]:
            raise PlanError(f"{source}: the cut {what[s - 1]} leaves pipeline stage {s - 1} empty (no computation "
                            "before it); remove it or move it later")
        if starts[s] >= end:
            raise PlanError(f"{source}: the cut {what[s - 1]} leaves pipeline stage {s} empty (no computation "
                            "after it); remove it or move it earlier")


def _param_costs(compute: list[fx.Node], ctx: CompileContext):
    """Each parameter's uses (positions in ``compute``) and bytes: what the automatic cut balances and the stage
    table reports, a parameter counted in every stage that uses it."""
    position = {n: i for i, n in enumerate(compute)}
    uses, nbytes = {}, {}
    for p in ctx.params:
        at = sorted(position[u] for u in p.users if u in position)
        val = p.meta.get("val")
        if at and isinstance(val, torch.Tensor):
            uses[p] = at
            nbytes[p] = val.numel() * val.element_size()
    return uses, nbytes


def _describe(cut: CutPlan, compute, blocks: Blocks | None, ctx: CompileContext, costs) -> CutPlan:
    """Per-stage label and cost row: the blocks it holds, forward FLOPs and parameter bytes per microbatch."""
    S = len(cut.starts)
    ends = cut.starts[1:] + [len(compute)]
    uses, nbytes = costs
    block_first = block_spans(compute, blocks)[0] if blocks else {}
    tp = ctx.layout.tp
    for s in range(S):
        lo, hi = cut.starts[s], ends[s]
        held = [b for b, i in block_first.items() if lo <= i < hi]
        flops = sum(node_flops(n) for n in compute[lo:hi])
        here = [p for p, at in uses.items() if any(lo <= i < hi for i in at)]
        params = sum(nbytes[p] for p in here)
        local_params = 0
        for p in here:
            val = p.meta["val"]
            local_params += math.prod(local_shape(tuple(val.shape), spec(p).placement, tp)) * val.element_size()
        label = _range_label(held, blocks)
        extra = []
        if s == 0 and (not held or lo < block_first.get(held[0], lo)):
            extra.append("before blocks")
        if s == S - 1 and held and blocks and held[-1] == blocks.names[-1]:
            extra.append("after blocks")
        if not held:
            label = "no block"
        cut.labels.append(label + (f" (+ {', '.join(extra)})" if extra else ""))
        cut.table.append({"stage": s, "pp_rank": ctx.layout.stage_rank(s), "holds": cut.labels[-1],
                          "blocks": len(held), "flops": flops, "param_bytes": params,
                          "local_param_bytes": local_params})
    return cut


def _range_label(held: list[str], blocks: Blocks | None) -> str:
    if not held or blocks is None:
        return ""
    first, last = held[0], held[-1]
    if first == last:
        return first
    return f"{blocks.prefix}.{first[len(blocks.prefix) + 1:]}-{last[len(blocks.prefix) + 1:]}"

