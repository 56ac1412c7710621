"""Static checks at the end of every compile: the per-rank graph runs, with the shapes we promised.

Every node is executed on fake tensors with its rank-local input shapes, and its output is
compared with the global shape divided by its placement.  A shape constant the tensor-parallel
pass did not localize, or an op whose sharding rule is wrong, shows up here — at compile time,
naming the module and the op — instead of as a shape error on a cluster.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.errors import ShardingError
from fxshard.ir.context import CompileContext, spec
from fxshard.ir.fake import fake_mode, run_fake, same_shape
from fxshard.ir.layout import Coords
from fxshard.ir.placement import local_shape


def checks_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    mode = fake_mode()
    first = None
    for tp_rank in range(ctx.layout.tp):
        coords = Coords(tp=tp_rank)
        env = run_fake(gm, ctx, coords, mode, first)
        first = first or env
        shapes = {node: tuple(v.shape) for node, v in env.items() if isinstance(v, torch.Tensor)}
        for node, found in shapes.items():
            val = node.meta.get("val")
            placement = spec(node).placement
            if not isinstance(val, torch.Tensor) or isinstance(placement, tuple):
                continue
            expected = local_shape(tuple(val.shape), placement, ctx.layout.tp)
            if not same_shape(found, expected):
                raise ShardingError(
                    f"{spec(node).fqn or 'model'}: {node.name} = {node.target} computes shape {list(found)} on "
                    f"tp rank {tp_rank}, expected {list(expected)} (global {list(val.shape)}, {placement}); "
                    "this op's sharding is not supported — replicate this module in the plan"
                )
    return gm
