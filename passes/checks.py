"""Static checks at the end of every compile: the per-rank graph runs, with the shapes we promised.

Every node is executed on fake tensors with its rank-local input shapes, and its output is
compared with the global shape divided by its placement.  A shape constant the tensor-parallel
pass did not localize, or an op whose sharding rule is wrong, shows up here — at compile time,
naming the module and the op — instead of as a shape error on a cluster.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxshard.context import CompileContext, Group, RankValue, spec
from fxshard.errors import ShardingError
from fxshard.placement import local_shape
from fxshard.runtime import collectives as rtc


def local_value_shapes(gm: fx.GraphModule, ctx: CompileContext, coords: dict[str, int]) -> dict[fx.Node, tuple]:
    """Run the rank graph on fake tensors; return each tensor node's local shape."""
    tp = ctx.layout.tp
    env: dict[fx.Node, object] = {}
    shapes: dict[fx.Node, tuple] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def value(a):
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, RankValue):
            return a.at(coords)
        return a

    with mode:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    env[node] = torch.empty(local_shape(tuple(val.shape), spec(node).placement, tp), dtype=val.dtype)
                else:
                    env[node] = val
                continue
            if node.op == "output":
                continue
            args = fx.node.map_arg(node.args, value)
            kwargs = fx.node.map_arg(node.kwargs, value)
            args = torch.utils._pytree.tree_map(value, args)
            kwargs = torch.utils._pytree.tree_map(value, kwargs)
            if node.target is operator.getitem:
                env[node] = args[0][args[1]]
            elif node.target in (rtc.all_reduce, rtc.copy_to):
                env[node] = args[0].clone()
            elif node.target is rtc.all_gather:
                x = args[0]
                size = list(x.shape)
                size[kwargs["dim"]] *= tp
                env[node] = torch.empty(size, dtype=x.dtype)
            elif node.target is rtc.scatter:
                env[node] = rtc.shard(args[0], kwargs["dim"], kwargs["index"], kwargs["parts"], kwargs["blocks"])
            else:
                args = tuple(a for a in args if not isinstance(a, Group))
                try:
                    env[node] = node.target(*args, **kwargs)
                except Exception as e:
                    raise ShardingError(
                        f"{spec(node).fqn or 'model'}: {node.name} ({node.target}) fails on the per-rank shapes "
                        f"at {coords}: {type(e).__name__}: {str(e).splitlines()[0]}"
                    ) from e
            out = env[node]
            if isinstance(out, torch.Tensor):
                shapes[node] = tuple(out.shape)
    return shapes


def checks_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    coords = {"dp": 0, "pp": 0, "tp": 0}
    for tp_rank in range(ctx.layout.tp):
        coords = coords | {"tp": tp_rank}
        shapes = local_value_shapes(gm, ctx, coords)
        for node, found in shapes.items():
            val = node.meta.get("val")
            placement = spec(node).placement
            if not isinstance(val, torch.Tensor) or isinstance(placement, tuple):
                continue
            expected = local_shape(tuple(val.shape), placement, ctx.layout.tp)
            if found != expected:
                raise ShardingError(
                    f"{spec(node).fqn or 'model'}: {node.name} = {node.target} computes shape {list(found)} on "
                    f"tp rank {tp_rank}, expected {list(expected)} (global {list(val.shape)}, {placement}); "
                    "this op's sharding is not supported — replicate this module in the plan"
                )
    return gm
