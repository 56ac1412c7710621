"""The per-rank graph run on fake tensors: each node's value at a rank's coordinates, its shapes, dtypes and strides.

The static checks at the end of a compile (``passes/checks.py``) compare what this gives with the shapes the
placements promise; ``fxshard plan`` runs a stage through it to see what autograd saves (:mod:`fxshard.cost.saved`)
and reads each node's local shape (:mod:`fxshard.cost.costs`, :mod:`fxshard.cost.profile`)::

    shapes = local_value_shapes(gm, ctx, Coords(tp=1))     # node -> its local shape on tp rank 1
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxshard.errors import ShardingError
from fxshard.ir.comm import kind_of
from fxshard.ir.context import CompileContext, Group, RankValue, spec
from fxshard.ir.layout import Coords
from fxshard.ir.placement import local_shape


def local_value_shapes(gm: fx.GraphModule, ctx: CompileContext, coords: Coords) -> dict[fx.Node, tuple]:
    """Run the rank graph on fake tensors; return each tensor node's local shape."""
    env = run_fake(gm, ctx, coords, fake_mode())
    return {node: tuple(v.shape) for node, v in env.items() if isinstance(v, torch.Tensor)}


def fake_mode() -> FakeTensorMode:
    """Fake tensors with a shape environment, so an op whose output size depends on the data (``aten.nonzero``
    under a boolean index, ``logits[mask]``) gets a symbolic size instead of failing."""
    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def same_shape(a, b) -> bool:
    """Shapes equal where both sizes are known; a size that depends on the data (a symbol) is not checked."""
    return len(a) == len(b) and all(x == y for x, y in zip(a, b, strict=True)
                                    if not isinstance(x, torch.SymInt) and not isinstance(y, torch.SymInt))


def argument_values(env: dict, coords: Coords):
    """What a node's argument is on fake tensors at ``coords``: a node its value in ``env``, a :class:`RankValue`
    its value there, a device the CPU (generated code runs on ``self.device``; a meta capture names "meta")."""
    def value(a):
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, RankValue):
            return a.at(coords)
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a
    return value


def run_fake(gm: fx.GraphModule, ctx: CompileContext, coords: Coords, mode: FakeTensorMode,
             base: dict[fx.Node, object] | None = None) -> dict[fx.Node, object]:
    """Each node's fake value at ``coords``.  With ``base`` (the values at another tp coordinate, same
    ``mode``), a node is re-run only when an argument depends on the rank (a ``RankValue``) or an input
    came out different from ``base``: fake values are shapes, dtypes and strides, so every other node
    gives the same result.  This keeps the check of all tp ranks close to the cost of one."""
    env: dict[fx.Node, object] = {}
    changed: set[fx.Node] = set()
    value = argument_values(env, coords)
    with mode:
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            if base is not None and node.op != "placeholder" and not _depends_on_rank(node, changed):
                env[node] = base[node]
                continue
            env[node] = fake_value(node, value, coords, ctx)
            if base is not None and not _same_fake(env[node], base[node]):
                changed.add(node)
    return env


def _depends_on_rank(node: fx.Node, changed: set[fx.Node]) -> bool:
    leaves = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
    return any(isinstance(a, RankValue) or (isinstance(a, fx.Node) and a in changed) for a in leaves)


def _same_fake(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _concrete(a) and _concrete(b) and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_fake(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b


def _concrete(t: torch.Tensor) -> bool:
    return not any(isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride()))


def fake_value(node: fx.Node, value, coords: Coords, ctx: CompileContext):
    """``node``'s value at ``coords`` from its arguments' (``value`` maps an argument: :func:`argument_values`): a
    placeholder's local shape, a collective's local output (:mod:`fxshard.ir.comm`), else the op itself on the fake
    arguments; also how ``fxshard plan`` runs a stage to see what autograd saves (:mod:`fxshard.cost.saved`)."""
    if node.op == "placeholder":
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty(local_shape(tuple(val.shape), spec(node).placement, ctx.layout.tp), dtype=val.dtype)
        return val
    args = torch.utils._pytree.tree_map(value, fx.node.map_arg(node.args, value))
    kwargs = torch.utils._pytree.tree_map(value, fx.node.map_arg(node.kwargs, value))
    if node.target is operator.getitem:
        return args[0][args[1]]
    kind = kind_of(node.target)
    if kind is not None:  # what the collective makes of this rank's input (fxshard.ir.comm)
        groups = [a for a in args if isinstance(a, Group)]
        size = ctx.layout.size(groups[0].axis) if groups else 1
        return kind.fake(args[0], size, **kwargs)
    args = tuple(a for a in args if not isinstance(a, Group))
    if node.target is torch.ops.aten.histc.default and not args[0].is_floating_point():
        # a capture on meta tensors takes transformers' non-CPU path of a MoE layer (histc of the expert ids as int),
        # which CPU kernels and their fake checks refuse; the result's shape does not depend on the input's dtype
        return node.target(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
    try:
        return node.target(*args, **kwargs)
    except Exception as e:
        raise ShardingError(
            f"{spec(node).fqn or 'model'}: {node.name} ({node.target}) fails on the per-rank shapes "
            f"at {coords}: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e
