"""How a column-parallel layer's output columns are packed, read off the graph that consumes them.

A fused projection is cut into blocks by the model's own code: GPT-2's ``c_attn`` into q, k, v (``split``), a
Mamba-2 ``in_proj`` into z, xBC, dt and, after the depthwise convolution, xBC into x, B, C (``split_with_sizes``,
unequal sizes).  Each block must be split over tp on its own (rank r holds part r of each), so the walk below
follows the output through ops that keep its columns as they are (transposes, elementwise ops, a depthwise
convolution) to the splits, and returns the blocks in order.

A block the model then views as ``g`` heads or groups of equal size (``view(b, s, g, d)``: key/value heads, a
Mamba-2 mixer's groups of B and C) must be split along those heads.  When g is fewer than tp and divides it, the
block is cut into g parts, each held by tp/g ranks (``Shard.parts``)::

    column_split(in_proj, packed=0, tp=4)   # Shard(0, blocks=5, sizes=(128, 128, 16, 16, 8), parts=(0, 0, 1, 1, 0))
    column_split(k_proj, packed=1, tp=8)    # 4 key/value heads: Shard(0, parts=(4,))
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fxshard.graph import static_shape
from fxshard.ir.placement import Shard

aten = torch.ops.aten
_SPLITS = (aten.split, aten.split_with_sizes, aten.chunk)
_RESHAPES = (aten.view, aten.reshape, aten._unsafe_view)
_DEPTH = 16


def _shape(n: fx.Node) -> tuple[int, ...]:
    return static_shape(n.meta["val"])


def _packet(n: fx.Node):
    return getattr(n.target, "overloadpacket", None)


def column_split(node: fx.Node, out_dim: int, packed: int, tp: int) -> Shard:
    """The split of a column-parallel weight whose op's output is ``node`` (columns along its last dimension):
    ``packed`` equal blocks, or (``packed == 0``) the blocks the graph cuts the output into, each cut into fewer
    parts than tp where the model views it as fewer heads than tp (module docstring)."""
    last = len(_shape(node)) - 1
    pieces = _pieces(node, last, 0) if packed == 0 else [(_shape(node)[last] // packed, None, 0)] * packed
    sizes = tuple(size for size, _, _ in pieces)
    heads = [_heads(leaf, dim) if leaf is not None else None for _, leaf, dim in pieces]
    heads = _sibling_heads(sizes, heads)
    parts = tuple(_parts(h, tp) for h in heads)
    if packed == 1:
        parts = (_parts(_heads(node, last), tp),)
    return Shard(out_dim, len(sizes), sizes, parts)


def _sibling_heads(sizes: tuple[int, ...], heads: list[int | None]) -> list[int | None]:
    """A block the model never views as heads holds whole heads of its packed siblings' one head size (GPT-BigCode's
    multi-query ``c_attn``: q viewed as heads of 8, k and v of 8 each: one head apiece)."""
    widths = {size // h for size, h in zip(sizes, heads, strict=True) if h}
    if len(widths) != 1 or len(sizes) == 1:
        return heads
    (width,) = widths
    return [h if h or size % width else size // width for size, h in zip(sizes, heads, strict=True)]


def pieces(node: fx.Node) -> tuple[int, ...]:
    """The sizes of the blocks the graph cuts the last dimension of ``node`` into (one block: its size)."""
    return tuple(size for size, _, _ in _pieces(node, len(_shape(node)) - 1, 0))


def _parts(heads: int | None, tp: int) -> int:
    """Parts of a block of ``heads`` heads over tp ranks: one per rank (0), or as many as heads when they are
    fewer than tp and divide it."""
    return heads if heads is not None and heads < tp and tp % heads == 0 else 0


def _pieces(node: fx.Node, dim: int, depth: int) -> list[tuple[int, fx.Node, int]]:
    """``[(size, leaf, dim), ...]``: the blocks dimension ``dim`` of ``node`` is cut into, in order, each with the
    value that holds it whole (for :func:`_heads`)."""
    size = _shape(node)[dim]
    users = list(node.users)
    if depth > _DEPTH or len(users) != 1:
        return [(size, node, dim)]
    (user,) = users
    if _packet(user) in _SPLITS and _split_dim(user) == dim:
        items = sorted(user.users, key=lambda g: g.args[1])
        if [g.args[1] for g in items] != list(range(len(user.meta["val"]))):
            return [(size, node, dim)]
        return [piece for g in items for piece in _pieces(g, dim, depth + 1)]
    follow = _kept(user, node, dim)
    return [(size, node, dim)] if follow is None else _pieces(user, follow, depth + 1)


def _split_dim(split: fx.Node) -> int:
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return dim % len(_shape(split.args[0]))


def _kept(user: fx.Node, node: fx.Node, dim: int, alone: bool = False) -> int | None:
    """Where ``user`` puts dimension ``dim`` of its input ``node`` when it keeps that dimension's columns as they
    are (and each column apart from the others); None otherwise.  ``alone``: only ops of that one value (an
    elementwise product with another activation mixes in the other's layout)."""
    if not isinstance(user.meta.get("val"), torch.Tensor):
        return None
    others = [a for a in user.all_input_nodes if a is not node and isinstance(a.meta.get("val"), torch.Tensor)]
    if alone and others:
        return None
    if any(a.op == "call_function" and _along(a, len(_shape(node)) - dim, _shape(node)[dim]) for a in others):
        return None  # an elementwise product with another activation's columns: they are its layout too
    out, src = _shape(user), _shape(node)
    packet = _packet(user)
    if packet is aten.transpose:
        a, b = (d % len(src) for d in user.args[1:3])
        return b if dim == a else a if dim == b else dim
    if packet is aten.unsqueeze:
        return dim + (user.args[1] % len(out) <= dim)
    if packet is aten.permute:
        return [d % len(src) for d in user.args[1]].index(dim)
    if packet in _RESHAPES:
        before = math.prod(src[:dim])
        j = next((j for j in range(len(out)) if math.prod(out[:j]) == before), None)
        return j if j is not None and j < len(out) and out[j] == src[dim] else None
    if packet in (aten.conv1d, aten.conv2d):  # depthwise: each channel convolved on its own
        groups = user.args[6] if len(user.args) > 6 else user.kwargs.get("groups", 1)
        return 1 if user.args[0] is node and dim == 1 and groups == src[1] == out[1] else None
    if packet is aten.slice and (user.args[1] if len(user.args) > 1 else 0) % len(src) != dim:
        return dim
    elementwise = isinstance(user.target, torch._ops.OpOverload) and torch.Tag.pointwise in user.target.tags \
        or packet in (aten.to, aten._to_copy, aten.clone, aten.contiguous, aten.silu, aten.gelu, aten.dropout)
    if elementwise and len(out) >= len(src) and out[dim + len(out) - len(src)] == src[dim]:
        return dim + len(out) - len(src)
    return None


def _along(value: fx.Node, from_end: int, size: int) -> bool:
    """Whether ``value`` has a dimension of ``size`` at position ``from_end`` from its end (not broadcast)."""
    shape = _shape(value)
    return len(shape) >= from_end and shape[len(shape) - from_end] == size > 1


def _heads(node: fx.Node, dim: int, depth: int = 0) -> int | None:
    """The number of equal heads or groups the model views dimension ``dim`` of ``node`` as (``view(b, s, g, d)``),
    following ops that keep the dimension; None when it views none."""
    for user in node.users:
        if _packet(user) in _RESHAPES and isinstance(user.meta.get("val"), torch.Tensor):
            src, out = _shape(node), _shape(user)
            before = math.prod(src[:dim])
            j = next((j for j in range(len(out)) if math.prod(out[:j]) == before), None)
            if j is not None and j + 1 < len(out) and out[j] < src[dim] and src[dim] % out[j] == 0:
                return out[j]
        elif depth < _DEPTH and len(list(node.users)) == 1:
            follow = _kept(user, node, dim, alone=True)
            if follow is not None:
                return _heads(user, follow, depth + 1)
    return None
