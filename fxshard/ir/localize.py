"""The sizes export baked into an op's arguments, made a rank's: ``view(q, [2, 8, 4, 16])`` -> ``[2, 8, 2, 16]``.

Export records a ``view``'s shape, a ``split``'s sizes, a ``repeat_interleave``'s repeats and a grouped
convolution's groups as constants of the whole model.  Once a pass splits a value over ranks (tp, cp), the op must
ask for this rank's part; :func:`localize_sizes` rewrites the constants for the op's output and first input
placements, for the tensor-parallel pass (``passes/tensor_parallel.py``, over tp) and the context-parallel one
(``passes/context_parallel.py``, over cp)::

    localize_sizes(view, Shard(2), Shard(2), 2)     # view(q, [2, 8, 4, 16]) -> view(q, [2, 8, 2, 16])
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.errors import ShardingError
from fxshard.graph import node_fqn
from fxshard.ir.placement import Shard, local_shape
from fxshard.ir.sharding import argument, set_argument, shape, squeezed_dims
from fxshard.ir.sharding_mixers import local_groups, local_repeats
from fxshard.ir.twins import op_name

aten = torch.ops.aten
SIZED = {aten.view.default: "size", aten.reshape.default: "shape", aten._unsafe_view.default: "size",
         aten.expand.default: "size", aten.new_empty.default: "size"}  # op -> its argument of global sizes


def localize_sizes(node: fx.Node, out, first_input, parts: int) -> None:
    """Make the global sizes export baked into ``node`` (a ``view``'s shape, a ``split``'s sizes) this rank's, for
    its output placed ``out`` and its first input ``first_input`` over ``parts`` ranks (tp, or cp)."""
    if node.target in SIZED:
        sizes = argument(node, SIZED[node.target])
        if all(isinstance(s, int) for s in [*sizes, *node.meta["val"].shape]):
            set_argument(node, SIZED[node.target], list(local_shape(shape(node), out, parts)))
        else:
            set_argument(node, SIZED[node.target], _local_symbolic_sizes(node, sizes, out, parts))
    elif node.target is aten.unflatten.int and isinstance(out, Shard):
        dim = argument(node, "dim") % len(shape(node.args[0]))
        sizes = local_shape(shape(node), out, parts)[dim:dim + len(argument(node, "sizes"))]
        set_argument(node, "sizes", list(sizes))
    elif node.target in (aten.split.Tensor, aten.split_with_sizes.default) and isinstance(first_input, Shard):
        _localize_split(node, out, first_input, parts)
    elif node.target is aten.repeat_interleave.self_int and isinstance(out, Shard) \
            and out.dim == argument(node, "dim") % len(shape(node)):
        repeats, size = local_repeats(node, first_input, out, parts)
        set_argument(node, "repeats", repeats)
        if size is not None:
            set_argument(node, "output_size", size)
    elif getattr(node.target, "overloadpacket", None) in (aten.conv1d, aten.conv2d) and isinstance(out, Shard):
        set_argument(node, "groups", local_groups(node, first_input, parts))
    elif getattr(node.target, "overloadpacket", None) is aten.squeeze and isinstance(first_input, Shard):
        _localize_squeeze(node, first_input, parts)


def _local_symbolic_sizes(node: fx.Node, sizes: list, out, parts: int) -> list:
    """A view's sizes where one is computed at run time (a size the data decides, an fx node): the sizes as
    written, the split dimension's made this rank's."""
    if not isinstance(out, Shard) or parts == 1:
        return list(sizes)
    local = list(sizes)
    size = sizes[out.dim]
    if not isinstance(size, int):
        raise ShardingError(f"{node_fqn(node) or 'model'}: {node.name} = {op_name(node)} gives dimension {out.dim} a "
                            "size the data decides, which cannot be split over ranks; replicate this module")
    if size != -1:
        local[out.dim] = out.local_size(size, parts)
    return local


def _localize_split(node: fx.Node, outs, p: Shard, parts: int) -> None:
    """A split along the split dimension: equal parts of each piece, or (``outs``, the pieces' placements) each
    piece's own split of unequal packed blocks (z, xBC, dt of a Mamba-2 in_proj)."""
    dim = argument(node, "dim") % len(shape(node.args[0]))
    if dim != p.dim:
        return
    if not p.general:
        if node.target is aten.split.Tensor:
            set_argument(node, "split_size", argument(node, "split_size") // parts)
        else:
            set_argument(node, "split_sizes", [s // parts for s in argument(node, "split_sizes")])
        return
    sizes = [out.local_size(int(v.shape[dim]), parts) for out, v in zip(outs, node.meta["val"], strict=True)]
    if node.target is aten.split.Tensor:
        node.target = aten.split_with_sizes.default
        node.args, node.kwargs = (node.args[0], sizes, dim), {}
    else:
        set_argument(node, "split_sizes", sizes)


def _localize_squeeze(node: fx.Node, p: Shard, parts: int) -> None:
    """A split of size ``parts`` has parts of size 1, which the rank's ``squeeze`` would remove where the model's
    does not: name the dimensions the model removes (``squeeze.dims``, possibly none)."""
    if shape(node.args[0])[p.dim] // parts == 1:
        dims = squeezed_dims(node)
        node.target = aten.squeeze.dims
        node.args, node.kwargs = (node.args[0], dims), {}
