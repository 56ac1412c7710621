"""Which values of the graph autograd tracks: one definition for every pass that asks.

The collectives pass needs it (a replicated value entering split compute gets a ``copy_to`` only if a
gradient comes back through it; a slice of one is a ``scatter``, not a free ``shard``), the automatic plan
needs it (masks and rotary tables, which carry no gradient, may join a Megatron pair), and the pipeline
stages need it (the gradient of a received value is sent back).  Computed on the graph as it is when asked,
so the nodes earlier passes inserted (collectives, a bias added after the reduction) count like any other.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def is_differentiable(node: fx.Node) -> bool:
    """Whether ``node`` yields a floating (or complex) tensor that autograd can track; ``detach`` yields none."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals) and (
        node.target is not aten.detach.default
    )


def requires_grad(gm: fx.GraphModule, params: set[fx.Node]) -> set[fx.Node]:
    """The parameters and every differentiable result computed from them: what carries a gradient back::

        grad = requires_grad(gm, ctx.trainable)
        if value in grad: ...  # its consumer's backward sends a gradient to it
    """
    tracked = set(params)
    for node in gm.graph.nodes:  # graph order is topological: a node's inputs are decided before it
        if node.op == "call_function" and is_differentiable(node) and any(a in tracked for a in node.all_input_nodes):
            tracked.add(node)
    return tracked
