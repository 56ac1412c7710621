"""What each generated class runs, and the repeated blocks it calls as submodules, derived from the graph.

A rank file holds one class per pipeline stage it holds (``Stage{s}``), or one class for the whole rank
(``RankModule``).  :func:`bodies` gives each class's :class:`Body`: its nodes in order, the parameters and
buffers it holds, what it takes and what is read after it.  ``passes/blocks.py`` decides which contiguous
runs of a body's nodes become a repeated block's submodule and records it in each node's
``NodeSpec.block``; :func:`block_units` reads that decision back as :class:`BlockUnit` s, with what each
block holds, reads and returns following from the graph.  Code generation, the manifest's collective list
and the plan (:mod:`fxshard.cost.costs`) all read the units from here, so they see the blocks that run::

    for body in bodies(gm, ctx):
        for first, unit in block_units(body.nodes, body.state, body.keep, body.apart).items():
            print(body.stage, unit.fqn, [n.name for n in unit.inputs], "->", [n.name for n in unit.outputs])

As with the stages (:mod:`fxshard.ir.stages`), nothing is kept beside the graph: a pass that changes the
graph after the blocks pass only has to give the nodes it inserts their block.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from fxshard.graph import loss_cone
from fxshard.ir.comm import FUSED_LINEARS, REGATHERED
from fxshard.ir.context import CompileContext, spec
from fxshard.ir.stages import StageSpec, pipeline_stages
from fxshard.runtime import collectives as rtc


@dataclass
class Body:
    """The nodes one generated class runs: a pipeline stage (``stage``), or the whole rank (``stage`` None)."""

    stage: int | None
    nodes: list[fx.Node]  # compute, in graph order
    state: list[fx.Node]  # the parameter and buffer placeholders it holds
    inputs: list[fx.Node]  # what it takes: the user inputs, or what the previous stage sends, then ``keyword``
    keep: set[fx.Node]  # values read after it: the stage's outputs, or the graph's
    apart: set[fx.Node]  # nodes the class runs apart from any block: recomputed from an earlier stage, or
    # computing only the model's other outputs after the loss (``outputs_only``)
    outputs_only: list[fx.Node] = field(default_factory=list)  # without pipeline: trailing nodes training skips
    pipeline_stage: StageSpec | None = None
    keyword: list[fx.Node] = field(default_factory=list)  # a later stage's user inputs, taken from its microbatch


@dataclass(eq=False)  # hashed by identity: one unit per block
class BlockUnit:
    fqn: str  # the block's module, e.g. model.layers.2
    nodes: list[fx.Node]  # its compute, contiguous in the class's order
    state: list[fx.Node]  # parameters and buffers only its nodes read: the submodule holds them
    inputs: list[fx.Node]  # the values it reads from outside (activations, masks, shared weights), first use first
    outputs: list[fx.Node]  # its values read after it or returned by the class


def bodies(gm: fx.GraphModule, ctx: CompileContext) -> list[Body]:
    """Every class the program's rank files hold: each pipeline stage in order, or the one of the whole rank."""
    if ctx.pipeline is not None:
        return [Body(st.index, st.nodes, st.state, st.inputs + st.batch, set(st.outputs), set(st.recomputed), [], st,
                     st.batch) for st in pipeline_stages(gm, ctx)]
    state = ctx.program.state_by_name()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    only = outputs_only(gm, compute)
    return [Body(None, compute, [n for n in placeholders if n.name in state and n.users],
                 [n for n in placeholders if n.name not in state], set(out_node.all_input_nodes), set(only), only)]


def outputs_only(gm: fx.GraphModule, compute: list[fx.Node]) -> list[fx.Node]:
    """The trailing nodes that compute only the model's other outputs, which training can skip by returning
    early; none when such a node comes before something training runs (the order stays as captured)."""
    cone = loss_cone(gm)
    first_rest = next((i for i, n in enumerate(compute) if n not in cone), len(compute))
    rest = compute[first_rest:]
    return rest if not any(n in cone for n in rest) else []


def block_units(nodes: list[fx.Node], state_nodes: list[fx.Node], keep: set[fx.Node],
                apart: set[fx.Node] = frozenset()) -> dict[fx.Node, BlockUnit]:
    """The blocks among ``nodes`` (one class's, in order) that run as submodules, keyed by their first node:
    each run of consecutive nodes with the same ``NodeSpec.block`` (``apart``: nodes that belong to none here)."""
    runs: list[tuple[str, list[fx.Node]]] = []
    for n in nodes:
        block = "" if n in apart else spec(n).block
        if not runs or runs[-1][0] != block:
            runs.append((block, []))
        runs[-1][1].append(n)
    own_state = set(state_nodes)
    units: dict[fx.Node, BlockUnit] = {}
    for block, span in runs:
        if not block:
            continue
        inside = set(span)
        inputs: dict[fx.Node, None] = {}
        state: dict[fx.Node, None] = {}
        for n in span:
            for a in _reads(n):
                if a in inside:
                    continue
                if a in own_state and all(u in inside for u in a.users):
                    state[a] = None
                else:
                    inputs[a] = None
        outputs = [n for n in span if n in keep or any(u not in inside for u in n.users)]
        units[span[0]] = BlockUnit(block, span, list(state), list(inputs), outputs)
    return units


def _reads(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` reads, in order, a fused ``copy_to_linears`` (passes/overlap.py) and its outputs read
    as the ``copy_to`` and linears they replace: the fused op its input, output i the fused op and linear i's
    weight and bias.  So a block holds its parameters in the same order with and without ``--overlap``, in its
    class and in the manifest."""
    if node.target is rtc.copy_to_linears:
        return [node.args[0]]
    if node.target in REGATHERED:  # the gathered input, and the shard it keeps for backward
        return [node.args[0], node.kwargs["shard"]]
    fused = node.args[0] if node.target is operator.getitem else None
    if isinstance(fused, fx.Node) and fused.target in FUSED_LINEARS:
        i = node.args[1]
        return [a for a in (fused, fused.kwargs["weights"][i], fused.kwargs["biases"][i]) if a is not None]
    return node.all_input_nodes


def unit_of(units: dict[fx.Node, BlockUnit]) -> dict[fx.Node, BlockUnit]:
    """Node -> the unit it runs in, for the nodes of ``units``."""
    return {n: u for u in units.values() for n in u.nodes}


def held_state(body: Body, units: dict[fx.Node, BlockUnit]) -> dict[BlockUnit | None, set[fx.Node]]:
    """The parameters and buffers each class of ``body`` holds: each block submodule its own (key: its unit),
    the class of the body the rest (key: None)."""
    held: dict[BlockUnit | None, set[fx.Node]] = {u: set(u.state) for u in units.values()}
    held[None] = set(body.state).difference(*held.values())
    return held
