"""The model's repeated blocks as units of the generated code: each becomes a submodule of its stage.

A transformer's layers (the longest ``ModuleList`` of one class, :func:`fxshard.ir.cut.find_blocks`) run as
contiguous spans of the captured graph.  Code generation emits each span as a call of a submodule that holds
the block's own parameters, so a rank file reads as the model does (``self.model_layers_2(hidden_states,
...)``), identical blocks share one generated class, and recompute or per-block ZeRO 3 have their unit::

    units = block_units(nodes, state_nodes, blocks, keep={stage outputs}, exclude={recomputed nodes})
    units[first_node].inputs   # what the block reads from outside it, in first-use order

A block whose span is interleaved with other modules' nodes, or holds nodes that the class treats apart
(recomputed in a later stage, skipped when training), stays inline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from fxshard.ir.context import spec
from fxshard.ir.cut import Blocks, block_spans, under


@dataclass(eq=False)  # hashed by identity: one unit per block
class BlockUnit:
    fqn: str  # the block's module, e.g. model.layers.2
    nodes: list[fx.Node]  # its compute, contiguous in the class's order
    state: list[fx.Node]  # parameters and buffers only its nodes read: the submodule holds them
    inputs: list[fx.Node]  # the values it reads from outside (activations, masks, shared weights), first use first
    outputs: list[fx.Node]  # its values read after it or returned by the class


def block_units(nodes: list[fx.Node], state_nodes: list[fx.Node], blocks: Blocks | None, keep: set[fx.Node],
                exclude: set[fx.Node]) -> dict[fx.Node, BlockUnit]:
    """The blocks among ``nodes`` that can be emitted as submodules, keyed by their first node."""
    if blocks is None:
        return {}
    starts, ends = block_spans(nodes, blocks)
    own_state = set(state_nodes)
    units: dict[fx.Node, BlockUnit] = {}
    for b in blocks.names:
        if b not in starts:
            continue
        span = nodes[starts[b]:ends[b] + 1]
        if any(not under(spec(n).fqn, b) or n in exclude for n in span):
            continue
        inside = set(span)
        inputs: dict[fx.Node, None] = {}
        state: dict[fx.Node, None] = {}
        for n in span:
            for a in n.all_input_nodes:
                if a in inside:
                    continue
                if a in own_state and all(u in inside for u in a.users):
                    state[a] = None
                else:
                    inputs[a] = None
        outputs = [n for n in span if n in keep or any(u not in inside for u in n.users)]
        if outputs:
            units[span[0]] = BlockUnit(b, span, list(state), list(inputs), outputs)
    return units
