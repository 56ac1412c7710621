"""The model's repeated blocks as units of the program: each block a class runs becomes a submodule of it.

A transformer's layers (the outermost ``ModuleList`` with the most members, :func:`fxshard.ir.cut.find_blocks`) run as
contiguous spans of the captured graph.  This pass decides, for every class of the rank files (a pipeline
stage, or the whole rank: :func:`fxshard.ir.blocks.bodies`), which blocks it calls as a submodule, and records
the decision in each node's ``NodeSpec.block``.  So a rank file reads as the model does
(``self.model_layers_2(hidden_states, ...)``), identical blocks share one generated class, and the units of
recompute (``--recompute``: each block call is one recompute region, ``rt.recompute``) and of per-block ZeRO 3
are the blocks recorded here, which ``fxshard plan`` costs and ``fxshard check`` traces as they run.

A block whose span is interleaved with other modules' nodes, or holds nodes that its class runs apart
(recomputed from an earlier stage, or computing only the model's other outputs after the loss), stays
inline, as does a span whose values nothing after it reads.  What a block holds, reads and returns
follows from the graph (:func:`fxshard.ir.blocks.block_units`)::

    gm = blocks_pass(gm, ctx)
    {spec(n).block for n in gm.graph.nodes}   # {'', 'model.layers.0', 'model.layers.1', ...}
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir.blocks import Body, bodies
from fxshard.ir.context import CompileContext, spec, update_spec
from fxshard.ir.cut import Blocks, block_spans, find_blocks, under


def blocks_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if spec(node).block:
            update_spec(node, block="")
    blocks = find_blocks(ctx.program.module_types)
    if blocks is None:
        return gm
    for body in bodies(gm, ctx):
        for fqn, span in _extracted(body, blocks):
            for node in span:
                update_spec(node, block=fqn)
    return gm


def _extracted(body: Body, blocks: Blocks) -> list[tuple[str, list[fx.Node]]]:
    """The blocks ``body`` can call as submodules, each with its span of ``body.nodes``: every node in the
    span inside the block, none run apart, and some value of it read after it."""
    starts, ends = block_spans(body.nodes, blocks)
    found = []
    for b in blocks.names:
        if b not in starts:
            continue
        span = body.nodes[starts[b]:ends[b] + 1]
        if any(not under(spec(n).fqn, b) or n in body.apart for n in span):
            continue
        inside = set(span)
        if any(n in body.keep or any(u not in inside for u in n.users) for n in span):
            found.append((b, span))
    return found
