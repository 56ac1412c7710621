"""The pipeline stages of a cut program, derived from the graph and each node's ``NodeSpec.stage``.

The pipeline pass (``passes/pipeline.py``) decides which stage computes each node and records it in the
node's spec; what a stage holds, receives and sends follows from the graph and is derived here whenever
code generation or the cost model asks.  Nothing is kept between the two, so a pass that changes the graph
after the cut only has to give the nodes it inserts a stage.  For every value a stage uses but does not
compute:

* a **user input** (labels, attention mask, position ids) is taken **from the batch**: every rank has its
  microbatch, so stage 0 takes the inputs positionally from the schedule and a later stage takes the ones it
  reads by keyword (torch's schedules pass ``step``'s keyword arguments, split into microbatches, to every
  stage); no user input crosses stages;
* a value computed from buffers, constants and user inputs only (rotary tables, causal and padding masks,
  position ids, shifted labels) is **recomputed** in the stage that needs it — no communication, no gradient;
* anything else (activations, long skip connections) is **sent**, stage to stage, through every stage
  between producer and consumer.

So what crosses stages is, but for rare cases, an activation a gradient flows back through: all that torch
2.11's ``PipelineStage`` can receive, since it makes every received buffer require a gradient and sends one back
for each.  The rare cases (a value computed from the inputs across a collective, or by a sub-graph larger than
``_RECOMPUTE_LIMIT``, or from frozen weights alone) are sent as before, which torch 2.13 handles.

A parameter used by several stages (a tied embedding and output head) lives in each of them
(:func:`tied_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.graph import ancestors, walk
from fxshard.ir.context import CompileContext, spec

_RECOMPUTE_LIMIT = 400  # nodes: a larger constant sub-graph is sent instead


@dataclass
class StageSpec:
    index: int
    nodes: list[fx.Node]  # compute nodes in graph order, own and recomputed
    recomputed: set[fx.Node]
    inputs: list[fx.Node]  # stage 0: the user inputs; later stages: values received from the previous one
    batch: list[fx.Node]  # later stages: the user inputs it reads, taken by keyword from its microbatch
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
    batch: list[set[fx.Node]] = [set() for _ in range(S)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs[0] = [n for n in placeholders if n.name not in state_names and isinstance(n.meta.get("val"), torch.Tensor)]

    def add(lst: list, v) -> None:
        if v not in lst:
            lst.append(v)

    def route(v: fx.Node, a: int, b: int) -> None:
        for s in range(a, b):
            add(outputs[s], v)
            add(inputs[s + 1], v)

    def take(p: fx.Node, b: int) -> None:  # a placeholder stage b reads: a weight or buffer, or a user input
        (state if p.name in state_names else batch)[b].add(p)

    def need(v: fx.Node, b: int) -> None:
        if v.op == "placeholder":
            take(v, b)
            return
        a = spec(v).stage
        if a == b or v in recomputed[b]:
            return
        if a > b:  # graph order is topological, so this cannot happen
            raise AssertionError(f"{v.name} computed in stage {a} but used in stage {b}")
        cone = recomputable(v, state_names, cache, from_batch=True)
        if cone is None:
            route(v, a, b)
            return
        for c in cone:
            recomputed[b].add(c)
            for p in c.all_input_nodes:
                if p.op == "placeholder":
                    take(p, b)

    for n in compute:
        for a in n.all_input_nodes:
            need(a, spec(n).stage)
    for b in range(S):
        for n in list(recomputed[b]):
            for a in n.all_input_nodes:
                if a.op == "placeholder":
                    take(a, b)
    need(loss, S - 1)
    outputs[S - 1] = [loss]
    return [StageSpec(s, sorted(set(own[s]) | recomputed[s], key=position.__getitem__), recomputed[s] - set(own[s]),
                      inputs[s], [p for p in placeholders if p in batch[s]] if s else [], outputs[s],
                      [p for p in placeholders if p in state[s]], ctx.pipeline.labels[s])
            for s in range(S)]


def gradless_sends(stages: list[StageSpec], grad: set[fx.Node]) -> list[str]:
    """A compile note for each value a stage sends that is not floating point or carries no gradient (``grad``: the
    values a gradient flows back to): the rare cases the module docstring names, which torch 2.11 cannot run."""
    notes = []
    for st in stages[:-1]:
        for v in st.outputs:
            val = v.meta.get("val")
            if isinstance(val, torch.Tensor) and (not val.dtype.is_floating_point or v not in grad):
                what = "an integer tensor" if not val.dtype.is_floating_point else "a tensor no gradient flows back to"
                notes.append(f"pipeline stage {st.index} sends {v.name} ({str(val.dtype).removeprefix('torch.')}), "
                             f"{what}: torch >= 2.13 runs this, torch 2.11's PipelineStage fails on it (it makes every "
                             "received buffer require a gradient)")
    return notes


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


def recomputable(v: fx.Node, state_names, cache, from_batch: bool = False) -> list[fx.Node] | None:
    """The compute nodes producing ``v`` if they depend on buffers and constants only (``from_batch``: and user
    inputs, which every stage can take from its microbatch), else None."""
    if v in cache:
        return cache[v]
    cone: list[fx.Node] = []
    result: list[fx.Node] | None = None
    ok = True
    for n in ancestors([v]):
        if n.op == "placeholder":
            s = state_names.get(n.name)
            if (s is None and not from_batch) or (s is not None and s.kind == "parameter"):
                ok = False  # a weight (or a user input, unless taken from the batch): send the value instead
                break
            continue
        if n.op != "call_function" or spec(n).collective or torch.Tag.nondeterministic_seeded in getattr(
                n.target, "tags", ()):
            ok = False
            break
        cone.append(n)
        if len(cone) > _RECOMPUTE_LIMIT:
            ok = False
            break
    if ok and not _written_elsewhere(set(cone)):
        result = cone
    cache[v] = result
    return result


def _written_elsewhere(cone: set[fx.Node]) -> bool:
    """Whether a node outside ``cone`` writes in place into a value of it, directly or through a view: the cone
    alone would then recompute the value without that write.  transformers' ``shift_tokens_right`` (BART, T5,
    Marian...) builds the decoder's inputs as ``new_zeros``, then ``shifted[:, 1:] = labels[:, :-1]`` (a ``copy_``
    into a ``slice`` of it), then ``masked_fill_``: the cone of the last holds the first and itself, not the copy."""
    def outside(node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if u not in cone]

    def view_users(node: fx.Node) -> list[fx.Node]:  # a view: follow what it is used for
        schema = getattr(node.target, "_schema", None)
        return outside(node) if schema is not None and any(a.alias_info is not None for a in schema.arguments) else []

    return any(getattr(user.target, "_schema", None) is not None and user.target._schema.is_mutable
               for user in walk([u for node in cone for u in outside(node)], view_users))
