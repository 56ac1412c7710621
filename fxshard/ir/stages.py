"""The pipeline stages of a cut program, derived from the graph and each node's ``NodeSpec.stage``.

The pipeline pass (``passes/pipeline.py``) decides which stage computes each node and records it in the
node's spec; what a stage holds, receives and sends follows from the graph and is derived here whenever
code generation or the cost model asks.  Nothing is kept between the two, so a pass that changes the graph
after the cut only has to give the nodes it inserts a stage.  For every value a stage uses but does not
compute:

* a **user input** (labels, attention mask) is taken by stage 0 and sent on to the stages that
  need it;
* a value computed from buffers and constants only (rotary tables, causal masks, position ids) is
  **recomputed** in the stage that needs it — no communication, no gradient;
* anything else (activations, long skip connections) is **sent**, stage to stage, through every stage
  between producer and consumer.

A parameter used by several stages (a tied embedding and output head) lives in each of them
(:func:`tied_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.ir.context import CompileContext, spec

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


def pipeline_stages(gm: fx.GraphModule, ctx: CompileContext) -> list[StageSpec]:
    """Every stage of the cut ``ctx.pipeline``, with what it computes, recomputes, holds, receives and sends::

        for st in pipeline_stages(gm, ctx):
            print(st.index, [n.name for n in st.inputs], "->", [n.name for n in st.outputs])
    """
    state_names = ctx.program.state_by_name()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out_node.args[0][0]
    compute = [n for n in gm.graph.nodes if n.op == "call_function" and spec(n).stage is not None]
    position = {n: i for i, n in enumerate(compute)}
    S = ctx.layout.num_stages
    own: list[list[fx.Node]] = [[] for _ in range(S)]
    for n in compute:
        own[spec(n).stage].append(n)
    cache: dict[fx.Node, list[fx.Node] | None] = {}
    recomputed: list[set[fx.Node]] = [set() for _ in range(S)]
    state: list[set[fx.Node]] = [set() for _ in range(S)]
    inputs: list[list[fx.Node]] = [[] for _ in range(S)]
    outputs: list[list[fx.Node]] = [[] for _ in range(S)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs[0] = [n for n in placeholders if n.name not in state_names and isinstance(n.meta.get("val"), torch.Tensor)]

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
        a = spec(v).stage
        if a == b or v in recomputed[b]:
            return
        if a > b:  # graph order is topological, so this cannot happen
            raise AssertionError(f"{v.name} computed in stage {a} but used in stage {b}")
        cone = recomputable(v, state_names, cache)
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
            need(a, spec(n).stage)
    for b in range(S):
        for n in list(recomputed[b]):
            for a in n.all_input_nodes:
                if a.op == "placeholder":
                    state[b].add(a)
    need(loss, S - 1)
    outputs[S - 1] = [loss]
    return [StageSpec(s, sorted(set(own[s]) | recomputed[s], key=position.__getitem__), recomputed[s] - set(own[s]),
                      inputs[s], outputs[s], [p for p in placeholders if p in state[s]], ctx.pipeline.labels[s])
            for s in range(S)]


def tied_weights(gm: fx.GraphModule, stages: list[StageSpec], params: set[fx.Node]) -> list[tuple[fx.Node, list[int]]]:
    """The parameters several stages hold, each with those stages: the generated ``sync_tied_grads`` sums
    their gradients over those stages after backward, so every copy takes the same optimizer step."""
    held = [set(st.state) for st in stages]
    tied = []
    for p in (n for n in gm.graph.nodes if n in params):
        holders = [s for s, state in enumerate(held) if p in state]
        if len(holders) > 1:
            tied.append((p, holders))
    return tied


def recomputable(v: fx.Node, state_names, cache) -> list[fx.Node] | None:
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
