"""Cut the flat graph into pipeline stages; route values between stages; find weights shared by stages.

Runs after the tensor-parallel passes, on the graph with its collectives, so a stage is a
contiguous run of per-rank nodes (graph order is execution order).  For every value a stage uses
but does not compute:

* a **user input** (labels, attention mask) is taken by stage 0 and sent on to the stages that
  need it;
* a value computed from buffers and constants only (rotary tables, causal masks, position ids) is
  **recomputed** in the stage that needs it — no communication, no gradient;
* anything else (activations, long skip connections) is **sent**, stage to stage, through every stage
  between producer and consumer.

A parameter used by several stages (a tied embedding and output head) lives in each of them; the
generated ``sync_tied_grads`` sums its gradient over those stages after backward, so every copy takes
the same optimizer step.  Results go to ``ctx.pipeline`` (:class:`PipelineProgram`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxshard.capture.program import loss_cone, node_fqn
from fxshard.errors import LayoutError, PlanError
from fxshard.ir.autograd import requires_grad
from fxshard.ir.context import CompileContext, spec
from fxshard.ir.cut import Blocks, CutPlan, balance, block_spans, find_blocks, node_flops, segments, under
from fxshard.ir.placement import local_shape

_RECOMPUTE_LIMIT = 400  # nodes: a larger constant sub-graph is sent instead


@dataclass
class StageSpec:
    index: int
    nodes: list[fx.Node]  # compute nodes in graph order, own and recomputed
    recomputed: set[fx.Node]
    inputs: list[fx.Node]  # stage 0: the user inputs; later stages: values received from the previous one
    outputs: list[fx.Node]  # values sent to the next stage; the last stage: [loss]
    state: list[fx.Node]  # parameter / buffer placeholders this stage holds
    label: str = ""


@dataclass
class PipelineProgram:
    stages: list[StageSpec]
    cut: CutPlan
    microbatches: int
    produced_in: dict[fx.Node, int]  # value -> stage computing it (user inputs: -1)
    requires_grad: set[fx.Node]
    tied: list[tuple[fx.Node, list[int]]] = field(default_factory=list)  # parameter -> stages holding it


def pipeline_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    layout = ctx.layout
    if layout.pp == 1:
        return gm
    program = ctx.program
    state_names = program.state_by_name()
    # the last stage returns the loss alone, so what computes only the model's other outputs (e.g. the
    # logits gathered whole to be returned) runs nowhere
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out_node.args[0][0]
    if not isinstance(loss, fx.Node) or loss.op != "call_function":
        raise LayoutError("the loss is not computed by the model; pipeline parallelism needs a loss to train")
    live = loss_cone(gm)
    compute = [n for n in gm.graph.nodes if n.op == "call_function" and n in live]
    position = {n: i for i, n in enumerate(compute)}
    cut = _choose_cut(gm, compute, ctx)
    stage_of = {n: bisect.bisect_right(cut.starts, i) - 1 for i, n in enumerate(compute)}
    S = layout.num_stages

    grad = requires_grad(gm, ctx.params)
    own: list[list[fx.Node]] = [[] for _ in range(S)]
    for n in compute:
        own[stage_of[n]].append(n)
    recomputable_cache: dict[fx.Node, list[fx.Node] | None] = {}
    for s, nodes in enumerate(own):
        if all(_recomputable(n, state_names, recomputable_cache) is not None for n in nodes):
            raise PlanError(f"{cut.source}: the cuts leave pipeline stage {s} empty (no computation on the "
                            f"inputs or weights{', only constants' if nodes else ''}); move or remove a cut")
    recomputed: list[set[fx.Node]] = [set() for _ in range(S)]
    state: list[set[fx.Node]] = [set() for _ in range(S)]
    inputs: list[list[fx.Node]] = [[] for _ in range(S)]
    outputs: list[list[fx.Node]] = [[] for _ in range(S)]
    user_inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in state_names]
    for n in user_inputs:
        if n.users and not isinstance(n.meta.get("val"), torch.Tensor):
            raise LayoutError(f"input {n.name} is not a tensor ({n.meta.get('val')!r}) but the model uses it; "
                              "pipeline stages exchange tensors only: make it a tensor or a constant of the model")
    inputs[0] = [n for n in user_inputs if isinstance(n.meta.get("val"), torch.Tensor)]

    def add(lst: list, v) -> None:
        if v not in lst:
            lst.append(v)

    def route(v: fx.Node, a: int, b: int) -> None:
        for s in range(a, b):
            add(outputs[s], v)
            add(inputs[s + 1], v)

    def need(v: fx.Node, b: int) -> None:
        if v.op == "placeholder":
            if v.name in state_names:
                state[b].add(v)
            elif b > 0:
                route(v, 0, b)
            return
        a = stage_of[v]
        if a == b or v in recomputed[b]:
            return
        if a > b:  # graph order is topological, so this cannot happen
            raise AssertionError(f"{v.name} computed in stage {a} but used in stage {b}")
        cone = _recomputable(v, state_names, recomputable_cache)
        if cone is None:
            route(v, a, b)
            return
        for c in cone:
            recomputed[b].add(c)
            for p in c.all_input_nodes:
                if p.op == "placeholder":
                    state[b].add(p)

    for n in compute:
        for a in n.all_input_nodes:
            need(a, stage_of[n])
    for b in range(S):
        for n in list(recomputed[b]):
            for a in n.all_input_nodes:
                if a.op == "placeholder":
                    state[b].add(a)
    need(loss, S - 1)
    outputs[S - 1] = [loss]

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    stages = []
    for s in range(S):
        nodes = sorted(set(own[s]) | recomputed[s], key=position.__getitem__)
        stages.append(StageSpec(s, nodes, recomputed[s] - set(own[s]), inputs[s], outputs[s],
                                [p for p in placeholders if p in state[s]], cut.labels[s]))
    tied = []
    for p in placeholders:
        holders = [s for s in range(S) if p in state[s]]
        if len(holders) > 1 and p in ctx.params:
            tied.append((p, holders))
    produced_in = {n: stage_of[n] for n in compute} | {n: -1 for n in user_inputs}
    ctx.pipeline = PipelineProgram(stages, cut, ctx.microbatches, produced_in, grad, tied)
    return gm


def _recomputable(v: fx.Node, state_names, cache) -> list[fx.Node] | None:
    """The compute nodes producing ``v`` if they depend on buffers and constants only, else None."""
    if v in cache:
        return cache[v]
    cone, stack, seen = [], [v], set()
    result: list[fx.Node] | None = None
    ok = True
    while stack and ok:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            s = state_names.get(n.name)
            if s is None or s.kind == "parameter":
                ok = False  # a user input or a trainable weight: send the value instead
            continue
        if n.op != "call_function" or spec(n).collective:
            ok = False
            continue
        tags = getattr(n.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            ok = False
            continue
        cone.append(n)
        stack.extend(n.all_input_nodes)
        if len(cone) > _RECOMPUTE_LIMIT:
            ok = False
    if ok:
        result = cone
    cache[v] = result
    return result


# ---------------------------------------------------------------- where to cut

def _choose_cut(gm: fx.GraphModule, compute: list[fx.Node], ctx: CompileContext) -> CutPlan:
    S = ctx.layout.num_stages
    what = f"--pp {ctx.layout.pp}" + (f" x {ctx.layout.stages_per_rank} virtual stages" if S > ctx.layout.pp else "")
    blocks = find_blocks(ctx.program.module_types)
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
        raise PlanError(f"{what}: the model has no repeated blocks (a ModuleList of one class) to cut between; "
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
    position = {n: i for i, n in enumerate(compute)}
    first_use, nbytes = {}, {}
    for p in ctx.params:
        uses = [position[u] for u in p.users if u in position]
        val = p.meta.get("val")
        if uses and isinstance(val, torch.Tensor):
            first_use[p] = min(uses)
            nbytes[p] = val.numel() * val.element_size()
    return first_use, nbytes


def _describe(cut: CutPlan, compute, blocks: Blocks | None, ctx: CompileContext, costs) -> CutPlan:
    """Per-stage label and cost row: the blocks it holds, forward FLOPs and parameter bytes per microbatch."""
    S = len(cut.starts)
    ends = cut.starts[1:] + [len(compute)]
    first_use, nbytes = costs
    block_first = block_spans(compute, blocks)[0] if blocks else {}
    tp = ctx.layout.tp
    for s in range(S):
        lo, hi = cut.starts[s], ends[s]
        held = [b for b, i in block_first.items() if lo <= i < hi]
        flops = sum(node_flops(n) for n in compute[lo:hi])
        params = sum(nbytes[p] for p, i in first_use.items() if lo <= i < hi)
        local_params = 0
        for p, i in first_use.items():
            if lo <= i < hi:
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
    return f"{blocks.prefix}.{first.rsplit('.', 1)[1]}-{last.rsplit('.', 1)[1]}"

