"""The manifest's list of the collectives one rank file issues, read off the final graph.

Every communicating collective node (:mod:`fxshard.ir.comm`) of the classes the file holds, in the order the
file calls them: a pipeline stage's nodes, or the rank's, in graph order; a block submodule's at each call of
the block, by the names of the block's class (:func:`fxshard.codegen.lines.block_names`).  ``fxshard check``
compares what the rank files issue with this list, and the header's counts are made from it::

    collective_entries(gm, ctx, pp_rank=0)[0]
    # CollectiveEntry(op='all_reduce', group='tp', value='all_reduce', shape=(8, 16, 64), dtype='float32', ...)
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.codegen.lines import block_names, replica_elements
from fxshard.codegen.manifest import CollectiveEntry
from fxshard.ir.blocks import Body, block_units, bodies
from fxshard.ir.comm import KINDS
from fxshard.ir.context import CompileContext, Group, spec
from fxshard.ir.placement import local_shape


def collective_entries(gm: fx.GraphModule, ctx: CompileContext, pp_rank: int) -> tuple[CollectiveEntry, ...]:
    """The collectives of the rank file of pipeline coordinate ``pp_rank`` (every tp rank's file issues the same
    ones, on its own part), in the order its classes issue them."""
    held = set(ctx.layout.stages_of(pp_rank)) if ctx.pipeline is not None else {None}
    entries = []
    for body in bodies(gm, ctx):
        if body.stage in held:
            entries += _body_entries(body, ctx)
    return tuple(entries)


def _body_entries(body: Body, ctx: CompileContext) -> list[CollectiveEntry]:
    names: dict[fx.Node, str] = {}
    for unit in block_units(body.nodes, body.state, body.keep, body.apart).values():
        names |= block_names(unit, ctx)[1]
    skipped = set(body.outputs_only)
    entries = []
    for node in body.nodes:
        kind = KINDS.get(spec(node).collective and node.target.__name__)
        if kind is None or not kind.communicates:
            continue
        val = node.meta["val"]
        if kind.name == "sum_replicas":  # one all-reduce of the replicated parts in their slots
            val, shape = node.args[0][0].meta["val"], (replica_elements(node, ctx.layout.tp),)
        else:
            if isinstance(val, tuple):  # rt.copy_to_linears: its input, as the copy_to it replaces
                val = node.args[0].meta["val"]
            shape = tuple(local_shape(tuple(val.shape), spec(node.args[0]).placement, ctx.layout.tp))
        entries.append(CollectiveEntry(
            op=kind.name, group=next(a.axis for a in node.args if isinstance(a, Group)),
            value=names.get(node, node.name),
            shape=shape, dtype=str(val.dtype).removeprefix("torch."),
            backward=" + ".join(op for op, _ in kind.ops("backward")) or None,
            outputs_only=node in skipped,
            stage=body.stage))
    return entries
