"""Placement rules over the batch's rows that the tensor-parallel table does not hold (:mod:`fxshard.ir.rows`).

A split of the batch meets ops a split of weights never does: convolutions, pools and norms of a batch of images
(each sample on its own), indexing per row (a classifier's ``logits[arange(B), last_token]``, an MAE's
``gather(x, 1, ids_keep)``), reductions and losses that keep or sum over the rows, the random draws of a model's
forward, and ``arange(B)``, the row numbers (:class:`Ids`), which index a part's own rows exactly as the whole
batch's index the whole's.  Each rule returns a :class:`~fxshard.ir.sharding.Decision` or None (the op mixes rows,
or no rule here: ask the cp and tensor-parallel tables)::

    decision = rows_rule(node, args, placements)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.ir.placement import Partial, Replicate, Shard
from fxshard.ir.rows_picked import Picked, hit_rule, masked_scatter_rule, picked_rule, where_rows
from fxshard.ir.sharding import Decision, _norm, argument, rule_decision

aten = torch.ops.aten
R = Replicate()
SUM, AVG = Partial("sum"), Partial("avg")
# a scalar ratio of two sums over the batch (a masked loss over its mask's count): the parts' ratios average to the
# whole's where every part counts alike; passes/batch_rows.py computes it whole under --dp
RATIO = "ratio_of_sums"


@dataclass(frozen=True)
class Ids:
    """The numbers of the rows along ``dim`` (an ``arange`` over the batch): a part's values count its own rows, so
    they index its own rows as the whole batch's index the whole's, and mean nothing else."""

    dim: int = 0

    def moved(self, dim: int) -> Ids:
        return Ids(dim)

    def __str__(self) -> str:
        return f"I({self.dim})"


# ops whose value is made from no tensor's values (sizes, a fill): the same in every row, a part's the whole's part
FRESH = {aten.zeros, aten.ones, aten.full, aten.empty, aten.empty_strided, aten.new_zeros, aten.new_ones,
         aten.new_full, aten.new_empty, aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like,
         aten.scalar_tensor}
# and a whole value spread over rows (a weight expanded over the batch)
UNIFORM = FRESH | {aten.expand}
# draws of a size that follows the batch: fxshard.runtime.draws draws each element by its place in the whole batch
SOURCES = {aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low, aten.normal.float_float}
# ops computing each sample of dimension 0 on its own (a training batch norm: passes/batch_norm_sync.py syncs it)
_PER_SAMPLE = {aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution, aten.conv_transpose1d, aten.conv_transpose2d,
               aten.conv_transpose3d, aten.max_pool1d, aten.max_pool2d, aten.max_pool3d,
               aten.max_pool2d_with_indices, aten.max_pool3d_with_indices, aten.avg_pool1d, aten.avg_pool2d,
               aten.avg_pool3d, aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d,
               aten._adaptive_avg_pool2d, aten.adaptive_max_pool1d, aten.adaptive_max_pool2d, aten.upsample_nearest1d,
               aten.upsample_nearest2d, aten.upsample_bilinear2d, aten.upsample_bicubic2d, aten.upsample_linear1d,
               aten._upsample_bilinear2d_aa, aten._upsample_nearest_exact2d, aten.grid_sampler,
               aten.grid_sampler_2d, aten.group_norm, aten.native_group_norm, aten.instance_norm, aten.pixel_shuffle,
               aten.pixel_unshuffle, aten.im2col, aten.col2im, aten.batch_norm,
               aten._native_batch_norm_legit_no_training}
_LOSSES = {aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, aten.huber_loss, aten.binary_cross_entropy,
           aten.binary_cross_entropy_with_logits, aten.kl_div, aten.soft_margin_loss, aten.margin_ranking_loss,
           aten.hinge_embedding_loss, aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd}
_REDUCTION = {0: None, 1: AVG, 2: SUM}
# reductions along dimensions: over the rows they mix them (sum and mean are the tables' partial sums)
_ALONG_DIMS = {aten.var, aten.std, aten.var_mean, aten.std_mean, aten.logsumexp, aten.prod, aten.any, aten.all,
               aten.argmax, aten.argmin, aten.linalg_vector_norm, aten.norm, aten.count_nonzero, aten.nansum,
               aten.amax, aten.amin}
_MOVES = {aten.unsqueeze, aten.squeeze, aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.to, aten._to_copy,
          aten.clone, aten.contiguous, aten.alias, aten.detach, aten.lift_fresh_copy, aten.flatten, aten.unflatten}
_ZEROS = {aten.zeros, aten.zeros_like, aten.new_zeros}
# elementwise ops torch does not tag pointwise (the Python operators' overloads a mask is built with)
_ELEMENTWISE = {aten.__and__, aten.__or__, aten.__xor__, aten.__lshift__, aten.__rshift__,
                aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor, aten.bitwise_not, aten.logical_and,
                aten.logical_or, aten.logical_xor, aten.logical_not, aten.fill, aten.fill_, aten.zero_}


def shape(n: fx.Node) -> tuple:
    """``n``'s sizes, None for one the data decides (the rows a boolean mask selects)."""
    out = []
    for s in n.meta["val"].shape:
        try:
            out.append(int(s))
        except (TypeError, ValueError, RuntimeError):
            out.append(None)
    return tuple(out)


def rows_rule(node: fx.Node, args: list[fx.Node], placements: list) -> Decision | None:
    """The batch's decision for ``node`` with its tensor inputs at ``placements``, or None."""
    packet = getattr(node.target, "overloadpacket", None)
    if any(isinstance(p, Picked) for p in placements):  # a selection's row numbers (fxshard.ir.rows_picked)
        return picked_rule(node, args, placements)
    if any(isinstance(p, Ids) for p in placements):
        return _ids(node, args, placements, packet)
    if node.target is aten.where.default and len(node.args) == 1:
        return where_rows(node, args, placements)
    if packet in (aten.gt, aten.greater) and placements == [SUM]:  # the experts a batch hit
        return hit_rule(node, args, placements)
    if isinstance(node.target, torch._ops.OpOverload) and node.target.name() == "fxshard::ctc_loss":
        return _ctc(node, args, placements)
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace not in ("aten", "prims"):
        return _opaque(node, args, placements)
    if packet is aten.index:
        return _index(node, args, placements)
    rule = _BY_PACKET.get(packet)
    if rule is not None:
        return rule(node, args, placements)
    if packet in _PER_SAMPLE:
        return _per_sample(node, args, placements)
    if packet in _LOSSES:
        return _loss(node, args, placements)
    if packet in _ALONG_DIMS:
        return _reduce_along(node, args, placements)
    if node.target in (aten.sum.default, aten.mean.default) and isinstance(placements[0], Shard):
        return Decision(SUM if packet is aten.sum else AVG, tuple(placements))  # every element: a sum (mean) of parts
    if packet in (aten.sum, aten.mean) and isinstance(placements[0], Partial):
        return Decision(placements[0], tuple(placements))  # a sum of parts of a sum: linear in each part
    if packet in (aten.add, aten.sub) and len(args) == 2:
        return _zero_plus_partial(args, placements)
    if node.target is aten.div.Tensor and placements == [SUM, SUM] and shape(node) == ():
        return Decision(AVG, (SUM, SUM), RATIO)
    if packet in _ELEMENTWISE or _pointwise_in_place(node) or torch.Tag.pointwise in node.target.tags \
            or packet is aten.broadcast_tensors:
        return _elementwise(node, args, placements)
    if packet in (aten.concat, aten.concatenate):  # cat's aliases (Zamba2's torch.cat exports as concatenate)
        return rule_decision(_as(node, aten.cat.default), args, placements)
    return None


def _elementwise(node, args, placements) -> Decision | None:
    """An elementwise op of values split alike along their rows (sizes the data decides included: a boolean
    mask's selection), the whole ones broadcast along the rows; ``broadcast_tensors`` (a loss's operands) gives each
    of them at the common shape."""
    val = node.meta["val"]
    n = (val[0] if isinstance(val, (tuple, list)) else val).dim()
    split = {p.moved(p.dim + n - len(shape(a))) for a, p in zip(args, placements, strict=True) if isinstance(p, Shard)}
    if len(split) != 1 or any(isinstance(p, Partial) for p in placements):
        return None
    out = split.pop()
    for a, p in zip(args, placements, strict=True):
        d = out.dim - (n - len(shape(a)))
        if p == R and d >= 0 and shape(a)[d] != 1:
            return None  # a whole value as long as the rows: it pairs each row with another's
    need = tuple(p if isinstance(p, Shard) else R for p in placements)
    return Decision(tuple(out for _ in val) if isinstance(val, (tuple, list)) else out, need)


def _pointwise_in_place(node: fx.Node) -> bool:
    """``masked_fill_``, ``add_``, ...: the in-place form of an elementwise op writes each element from its own."""
    name = node.target.overloadpacket.__name__.split(".")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return False
    functional = getattr(getattr(aten, name[:-1], None), node.target._overloadname, None)
    return functional is not None and (torch.Tag.pointwise in functional.tags or functional.overloadpacket in (
        aten.masked_fill, aten.where, aten.clone, aten.copy))


def _as(node: fx.Node, target) -> fx.Node:
    """``node`` read as another op of the same schema (``concat``, ``concatenate`` as ``cat``), for the tables'
    rules."""
    twin = fx.Graph().create_node("call_function", target, node.args, node.kwargs)
    twin.meta = node.meta
    return twin


def _ids(node, args, placements, packet) -> Decision | None:
    """Row numbers move with the rows (``arange(B)[:, None]``) and index them (:func:`_index`,
    ``index_select``); used as values, they would be a part's numbers, not the whole's: no rule."""
    if packet is aten.index:
        return _index(node, args, placements)
    if packet is aten.index_select and isinstance(placements[0], Shard) and isinstance(placements[1], Ids):
        dim = _norm(argument(node, "dim"), len(shape(args[0])))
        if dim == placements[0].dim and shape(args[1])[0] == shape(args[0])[dim]:
            return Decision(placements[0], tuple(placements))
        return None
    if packet in (aten.index_put, aten.index_put_):
        return _row_write(node, args, placements)
    if packet in _MOVES and len(args) == 1:
        d = rule_decision(node, args, [Shard(placements[0].dim)])
        if d is not None and isinstance(d.out, Shard) and d.out.blocks == 1:
            return Decision(Ids(d.out.dim), tuple(placements))
    return None


def _broadcast_dim(a: fx.Node, p, n: int) -> int | None:
    """Where the rows of an index tensor ``a`` (placed ``p``) land among ``n`` broadcast index dimensions."""
    if isinstance(p, (Shard, Ids)):
        return p.dim + n - len(shape(a))
    return None


def _index(node, args, placements) -> Decision | None:
    """``x[i_0, i_1, ...]`` (``aten.index.Tensor``, None for ``:``): advanced indexing of each part's rows by its
    own index tensors.  The rows of ``x`` not indexed, every index whole (``h[:, perm]``); the rows indexed by
    their own numbers beside indices split alike (``logits[arange(B), last]``); a whole ``x`` looked up by split
    indices (an embedding table's rows); a boolean mask over the rows (``logits[mask]``: each part's selected rows,
    in order)."""
    indices = list(node.args[1])
    x, xp = args[0], placements[0]
    where = [d for d, i in enumerate(indices) if i is not None]
    places = dict(zip([i for i in indices if i is not None], placements[1:], strict=True))
    index_nodes = [indices[d] for d in where]
    if isinstance(xp, Partial) or any(isinstance(places[i], Partial) for i in index_nodes):
        return None
    if len(index_nodes) == 1 and index_nodes[0].meta["val"].dtype == torch.bool:
        return _mask(node, xp, places[index_nodes[0]], where[0], len(shape(index_nodes[0])))
    n = max(len(shape(i)) for i in index_nodes)
    adjacent = where == list(range(where[0], where[0] + len(where)))
    front = where[0] if adjacent else 0  # where the broadcast index dimensions sit in the result
    split = {_broadcast_dim(i, places[i], n) for i in index_nodes if places[i] != R}
    if isinstance(xp, Shard) and xp.dim not in where:
        if split or xp.blocks > 1:
            return None
        rest = [d for d in range(len(shape(x))) if d not in where]
        out = (xp.dim if xp.dim < where[0] else xp.dim - len(where) + n) if adjacent else n + rest.index(xp.dim)
        return Decision(Shard(out), tuple(placements))
    if len(split) != 1 or None in split or isinstance(xp, Shard) and xp.blocks > 1:
        return None
    j = split.pop()
    if isinstance(xp, Shard):  # the rows indexed: by their numbers, the other indices split alike
        ids = indices[xp.dim]
        if not isinstance(places.get(ids), Ids) or shape(ids)[places[ids].dim] != shape(x)[xp.dim]:
            return None
    if any(isinstance(places[i], Ids) and (not isinstance(xp, Shard) or i is not indices[xp.dim])
           for i in index_nodes):
        return None
    return Decision(Shard(front + j), tuple(placements))


def _mask(node, xp, mp, first: int, m: int) -> Decision | None:
    """``x[mask]`` with ``mask`` over dimensions ``first .. first+m`` of ``x``: the selected elements in order, so
    a split of the first masked dimension is each part's selection, in the whole's order."""
    if isinstance(xp, Shard) and xp.dim == first and mp == Shard(0) and xp.blocks == 1:
        return Decision(Shard(first), (xp, mp))
    if isinstance(xp, Shard) and xp.dim >= first + m and mp == R:
        return Decision(Shard(xp.dim - m + 1), (xp, mp))
    if xp == R and mp == Shard(0) and first == 0:
        return Decision(Shard(0), (xp, mp))
    return None


def _masked_select(node, args, placements) -> Decision | None:
    """``x.masked_select(mask)``: the selected elements of the broadcast shape in row-major order, so with its rows
    split alike each part's selection, in the whole's order (wav2vec2's CTC targets, of a size the data decides)."""
    n = len(shape(node.args[0])) if len(shape(node.args[0])) >= len(shape(node.args[1])) else len(shape(node.args[1]))
    split = {p.moved(p.dim + n - len(shape(a))) for a, p in zip(args, placements, strict=True) if isinstance(p, Shard)}
    if split != {Shard(0)} or any(p != R and not isinstance(p, Shard) for p in placements):
        return None
    if not _read_as_ctc_targets(node):
        return None
    return Decision(Shard(0), tuple(placements))


_SAME_ELEMENTS = {aten._to_copy, aten.clone, aten.view, aten.reshape, aten.alias, aten._unsafe_view}


def _read_as_ctc_targets(node: fx.Node) -> bool:
    """Whether a masked selection (a size the data decides) is read only as CTC targets, each sample's its own: a
    mean or any other reduction over it would average the parts' means, weighing parts of 10 and 30 selected
    elements alike (one device weighs them 10:30); such a selection is computed on the whole batch instead."""
    stack = [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if isinstance(u.target, torch._ops.OpOverload) and u.target.name() == "fxshard::ctc_loss" and \
                    u.args[1] is n and n not in u.args[2:]:
                continue
            if u.target is aten.sym_size.int and only_asserted(u):  # the range checks of its unbacked size
                continue
            if getattr(u.target, "overloadpacket", None) not in _SAME_ELEMENTS or u.all_input_nodes != [n]:
                return False
            stack.append(u)
    return True


def only_asserted(node: fx.Node) -> bool:
    """Whether ``node`` reaches nothing but runtime assertions, through ops of it and constants only."""
    stack = [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.target is aten._assert_scalar.default:
                continue
            if u.all_input_nodes != [n]:
                return False
            stack.append(u)
    return True


def _ctc(node, args, placements) -> Decision | None:
    """``fxshard::ctc_loss(log_probs [T, N, C], targets, input_lengths, target_lengths, blank, reduction, ..)``
    (fxshard/runtime/ctc.py): each sample's loss from its own frames, target and lengths, the targets each part's
    rows' (padded ``[N, S]``, or concatenated in row order: a masked selection's); ``"mean"`` averages the samples'
    losses (each over its target's length), so parts of equal rows average to the whole's, ``"sum"`` sums them."""
    lp, targets, lengths = node.args[0], node.args[1], node.args[2:4]
    if not all(isinstance(a, fx.Node) for a in (lp, targets, *lengths)) or len(shape(lp)) != 3:
        return None
    want = {lp: Shard(1), targets: Shard(0), lengths[0]: Shard(0), lengths[1]: Shard(0)}
    if any(p != want[a] for a, p in zip(args, placements, strict=True)):
        return None
    reduction = node.args[5] if len(node.args) > 5 else "mean"
    out = {"mean": AVG, "sum": SUM, "none": Shard(0)}.get(reduction)
    return Decision(out, tuple(placements)) if out is not None else None


def _mask_write(node, args, placements) -> Decision | None:
    """``x[mask] = v`` (``index_put`` with one boolean index over the leading dimensions): each part's rows
    written where its own mask is, ``v`` the same for every element written (a padding's zero) or each part's
    selection in order."""
    indices, values = list(node.args[1]), node.args[2]
    if len(indices) != 1 or indices[0] is None or indices[0].meta["val"].dtype != torch.bool:
        return None
    place = dict(zip(args, placements, strict=True))
    xp, mp = placements[0], place[indices[0]]
    vp = place.get(values, R) if isinstance(values, fx.Node) else R
    m = len(shape(indices[0]))
    whole_value = vp == R and len(shape(values)) <= len(shape(args[0])) - m if isinstance(values, fx.Node) else True
    if xp == Shard(0) and mp == Shard(0) and (whole_value or vp == Shard(0)):
        return Decision(xp, tuple(placements))
    return None


def _row_write(node, args, placements) -> Decision | None:
    """``x[arange(B), j] = v``: each row written at its own column(s) (HuBERT's feature mask, set at each row's
    last frame), ``v`` one value for all or each part's rows'."""
    indices, values = list(node.args[1]), node.args[2]
    place = dict(zip(args, placements, strict=True))
    first = indices[0] if indices else None
    if placements[0] != Shard(0) or first is None or place[first] != Ids(0) or shape(first) != shape(args[0])[:1]:
        return None
    if any(i is None or place[i] != Shard(0) or shape(i) != shape(first) for i in indices[1:]):
        return None
    vp = place.get(values, R) if isinstance(values, fx.Node) else R
    if vp == Shard(0) or vp == R and (not isinstance(values, fx.Node) or all(s == 1 for s in shape(values))):
        return Decision(Shard(0), tuple(placements))
    return None


def _gather(node, args, placements) -> Decision | None:
    """``gather(x, dim, index)`` / ``take_along_dim``: picks along ``dim`` within each row; the rows split alike."""
    x, index = placements[0], placements[1]
    dim = _norm(argument(node, "dim"), len(shape(args[0])))
    if isinstance(x, Shard) and x == index and x.dim != dim:
        return Decision(x, (x, index))
    return None


def _scatter(node, args, placements) -> Decision | None:
    """``scatter(x, dim, index, src)`` and its in-place and add forms: within each row along ``dim``, the rows split
    alike.  Along the rows into a zero table (a router's counts per expert): each part's sum, a partial sum."""
    x = placements[0]
    dim = _norm(argument(node, "dim"), len(shape(args[0])))
    rest = placements[1:]
    if isinstance(x, Shard) and x.dim != dim and all(p == x for p in rest):
        return Decision(x, tuple(placements))
    add = "add" in str(node.target) or argument(node, "reduce") == "sum"
    if x == R and add and _is_zeros(args[0]) and all(p == Shard(dim) for p in rest):
        return Decision(SUM, tuple(placements))
    return None


def _index_select(node, args, placements) -> Decision | None:
    """``index_select(x, dim, index)``: whole indices along another dimension than the rows; a whole table looked
    up by split indices (each part's rows of the result)."""
    x, index = placements
    dim = _norm(argument(node, "dim"), len(shape(args[0])))
    if isinstance(x, Shard) and x.dim != dim and index == R:
        return Decision(x, (x, index))
    if x == R and index == Shard(0):
        return Decision(Shard(dim), (x, index))
    return None


def _index_write(node, args, placements) -> Decision | None:
    """``index_add / index_copy / index_fill(x, dim, index, src)`` along another dimension than the rows, with whole
    indices: each row on its own."""
    x = placements[0]
    dim = _norm(argument(node, "dim"), len(shape(args[0])))
    src = args[2] if len(args) > 2 else None
    pi = placements[1]
    ps = placements[2] if src is not None else x
    if isinstance(x, Shard) and x.dim != dim and pi == R and ps in (x, R) and (ps == x or shape(src)[0] == 1):
        return Decision(x, tuple(placements))
    return None


def _per_sample(node, args, placements) -> Decision | None:
    """An op over a batch of samples (convolution, pooling, a group or batch norm): each sample of dimension 0 on
    its own, the weights whole.  Outputs that hold the samples keep the split; the others (running statistics)
    are whole."""
    x = placements[0]
    if x != Shard(0) or any(p != R for p in placements[1:]):
        return None
    val = node.meta.get("val")
    n = shape(args[0])[0]
    if isinstance(val, (tuple, list)):
        outs = tuple(Shard(0) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else R for v in val)
        return Decision(outs, tuple(placements))
    return Decision(Shard(0), tuple(placements))


def _loss(node, args, placements) -> Decision | None:
    """A loss per element whose inputs split their rows alike (a class weight or ``pos_weight`` whole; a cross
    entropy's targets beside its logits' rows): ``none`` keeps the split, ``mean`` averages the parts' means (the
    token-mean pass counts a mean over counted targets), ``sum`` adds the parts' sums."""
    split = {p for p in placements if p != R}
    if len(split) != 1:
        return None
    p = split.pop()
    if not isinstance(p, Shard) or p.blocks > 1 or not isinstance(placements[0], Shard):
        return None
    n = len(shape(args[0]))
    classes = node.target.overloadpacket in (aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd)
    if classes and (p.dim != 0 or placements[1] != p or any(q != R for q in placements[2:])):
        return None
    for a, q in zip(args, placements, strict=True):
        if classes:
            break
        if q == R and len(shape(a)) > n - 1 - p.dim and shape(a)[p.dim - (n - len(shape(a)))] != 1:
            return None
        if isinstance(q, Shard) and q.dim - len(shape(a)) != p.dim - n:
            return None
    out = _REDUCTION.get(argument(node, "reduction", 1), AVG)
    return Decision(out or p, tuple(placements))


def _reduce_along(node, args, placements) -> Decision | None:
    """A reduction along dimensions other than the rows keeps them split; along the rows, only a sum of the parts'
    sums (``nansum``) is a rule."""
    p = placements[0]
    if not isinstance(p, Shard) or any(q != R for q in placements[1:]):
        return None
    n = len(shape(args[0]))
    dim = argument(node, "dim")
    dims = set(range(n)) if dim is None or dim == [] else {_norm(d, n) for d in (dim if isinstance(dim, (list, tuple))
                                                                                 else [dim])}
    if p.dim in dims:
        return Decision(SUM, (p,)) if node.target.overloadpacket is aten.nansum and dims == set(range(n)) else None
    keep = argument(node, "keepdim", False)
    out = p if keep else p.moved(p.dim - sum(d < p.dim for d in dims))
    val = node.meta.get("val")
    return Decision(tuple(out for _ in val) if isinstance(val, (tuple, list)) else out, tuple(placements))


def _zero_plus_partial(args, placements) -> Decision | None:
    """``zeros + part`` (a sum started from a zero table, as transformers' router loss adds its layers' counts): the
    part's sum."""
    if SUM in placements and any(p == R and _is_zeros(a) for a, p in zip(args, placements, strict=True)):
        return Decision(SUM, tuple(placements))
    return None


def _is_zeros(node: fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return packet in _ZEROS or packet in (aten.full, aten.new_full, aten.full_like) and argument(
        node, "fill_value") == 0


def _opaque(node, args, placements) -> Decision | None:
    """An op fxshard cannot read (a custom op, a model's ``autograd.Function``): taken as computing each row on its
    own where its inputs split their rows alike and each output keeps as many rows."""
    split = {p for p in placements if p != R}
    if len(split) != 1 or not isinstance(next(iter(split)), Shard):
        return None
    p = split.pop()
    size = shape(args[placements.index(p)])[p.dim]
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    outs = []
    for v in vals:
        if not isinstance(v, torch.Tensor):
            outs.append(R)
        elif v.dim() > p.dim and int(v.shape[p.dim]) == size:
            outs.append(p)
        else:
            return None
    return Decision(tuple(outs) if isinstance(val, (tuple, list)) else outs[0], tuple(placements))


def _kept_dims(node, args, placements, *names) -> Decision | None:
    """An op along the dimensions named by ``names`` (``roll``, ``flip``, ``unfold``, ``one_hot``): the rows kept
    where it does not act on them."""
    p = placements[0]
    if not isinstance(p, Shard) or any(q not in (R, p) for q in placements[1:]):  # a diff's prepend beside its rows
        return None
    n = len(shape(args[0]))
    acted = set()
    for name in names:
        value = argument(node, name)
        for d in (value if isinstance(value, (list, tuple)) else [value] if value is not None else []):
            acted.add(_norm(d, n))
    if node.target.overloadpacket is aten.roll and not argument(node, "dims"):
        return None  # a roll of the flattened tensor
    return Decision(p, tuple(placements)) if p.dim not in acted else None


def _repeat(node, args, placements) -> Decision | None:
    """``x.repeat(r_0, ..)``: the rows kept where they are not repeated."""
    p = placements[0]
    repeats = list(argument(node, "repeats"))
    if not isinstance(p, Shard) or p.blocks > 1:
        return None
    d = p.dim + len(repeats) - len(shape(args[0]))
    return Decision(p.moved(d), (p,)) if repeats[d] == 1 else None


def _expand_as(node, args, placements) -> Decision | None:
    """``x.expand_as(other)``: ``x``'s rows where it has them at the result's size (only ``other``'s shape is read:
    it stays as it is)."""
    p, other = placements[0], placements[1]
    n = len(shape(node))
    if isinstance(p, Shard):
        od = p.dim + n - len(shape(args[0]))
        return Decision(p.moved(od), tuple(placements)) if shape(args[0])[p.dim] == shape(node)[od] else None
    if p == R and isinstance(other, Shard):  # a whole value spread over the rows: the same in every row
        return Decision(other, tuple(placements))
    return None


def _counts(node, args, placements) -> Decision | None:
    """``histc`` of split values: each part's counts, a partial sum."""
    return Decision(SUM, tuple(placements)) if isinstance(placements[0], Shard) else None


def _multinomial(node, args, placements) -> Decision | None:
    """Draws from each row of probabilities: the rows split alike; the categories of a 1-d distribution over the
    rows would be drawn across them (no rule)."""
    p = placements[0]
    return Decision(p, (p,)) if isinstance(p, Shard) and p.dim == 0 and len(shape(args[0])) == 2 else None


_BY_PACKET = {
    aten.gather: _gather, aten.take_along_dim: _gather,
    aten.scatter: _scatter, aten.scatter_: _scatter, aten.scatter_add: _scatter, aten.scatter_add_: _scatter,
    aten.scatter_reduce: _scatter, aten.scatter_reduce_: _scatter,
    aten.index_select: _index_select, aten.masked_select: _masked_select, aten.masked_scatter: masked_scatter_rule,
    aten.index_put: _mask_write, aten.index_put_: _mask_write,
    aten.index_add: _index_write, aten.index_add_: _index_write, aten.index_copy: _index_write,
    aten.index_copy_: _index_write, aten.index_fill: _index_write, aten.index_fill_: _index_write,
    aten.roll: lambda n, a, p: _kept_dims(n, a, p, "dims"), aten.flip: lambda n, a, p: _kept_dims(n, a, p, "dims"),
    aten.diff: lambda n, a, p: _kept_dims(n, a, p, "dim"),
    aten.unfold: lambda n, a, p: _kept_dims(n, a, p, "dimension"),
    aten.one_hot: lambda n, a, p: _kept_dims(n, a, p),
    aten.repeat: _repeat, aten.histc: _counts, aten.multinomial: _multinomial, aten.expand_as: _expand_as,
}
