"""Rows a model selects (:mod:`fxshard.ir.rows`): ``torch.where(mask)`` over a row-split mask, the rows looked up by
those numbers, and the results written back to them; a ``masked_scatter`` into the rows.

An eager mixture-of-experts loops over the experts its batch hit (Switch Transformers, DBRX, Mixtral's eager
experts)::

    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))     # the rows routed to this expert
        out = expert(hidden_states[top_x]) * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, out)                                  # each row's own result, added back

Over a part of the batch, ``torch.where`` gives the numbers of the part's own rows (:class:`Picked`, a count the
data decides), which index the part's rows exactly as the whole batch's index the whole's.  Each token's result
then depends on its own row alone, so the split is exact, under strict conditions: the numbers index only the
row space they number (the same size along the rows, :func:`picked_rule`), the values picked beside them
(``idx``, the slot of each selected entry) are used only beside them (the same count), and the write back goes
to a row-split tensor by the same numbers.  Anything else reading them is no rule: computed on the whole batch,
which fxshard cannot do for a part's own row numbers, so the compile is refused naming the op.

The loop itself is Python over the batch's hit experts, specialized on the example batch
(:mod:`fxshard.capture.specialize`): :func:`hit_rule` makes ``greater(sum over the rows, 0)`` the same in every
part where the program asserts every value read of its ``nonzero()`` (the count, and each expert's number) and the
sum adds values that cannot be negative (a one-hot mask): then every part hits the example's experts, and so
does the whole batch (an expert is hit by the whole batch exactly when some part hits it).

Two more ways a model selects rows: ``x.masked_scatter(mask, source)`` (Llava's image features into its image
tokens, :func:`masked_scatter_rule`: each part's own where the program asserts each part's counts agree), and a
selection's count or mean read as a number (:func:`part_count`, :func:`averages_selection`: refused, each part's
count is not the whole batch's).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.ir.placement import Partial, Replicate, Shard
from fxshard.ir.sharding import Decision, _norm, argument

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


@dataclass(frozen=True)
class Picked:
    """The numbers of rows a selection picked (``torch.where(mask)[d]`` for a mask split along ``d``): dimension
    ``dim`` lists a part's selected entries (a count the data decides), each value the number of one of the part's
    own rows along a dimension of ``rows`` (its size at the program analysed): they index those rows alone."""

    dim: int = 0
    rows: int = 0

    def moved(self, dim: int) -> Picked:
        return Picked(dim, self.rows)

    def __str__(self) -> str:
        return f"N({self.dim})"


# ops that keep a tensor's values and shape: the numbers stay what they were
_SAME = {aten._to_copy, aten.to, aten.clone, aten.alias, aten.detach, aten.lift_fresh_copy, aten.contiguous}
# dtypes that hold a row number as it is, whatever the batch's size: a narrower one (uint8's wrap, bfloat16's
# rounding) changes the whole batch's numbers where it keeps a part's smaller ones (each part's rows from 0)
_NUMBERS = (torch.int32, torch.int64)


def picked_rule(node: fx.Node, args: list[fx.Node], placements: list) -> Decision | None:
    """The decision for ``node`` reading row numbers (a :class:`Picked` input), or None."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet in _SAME and len(args) == 1:  # a copy in a dtype that holds every row number (not uint8, bfloat16)
        exact = isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dtype in _NUMBERS
        return Decision(placements[0], tuple(placements)) if exact else None
    if packet is aten.index:
        return _picked_index(node, args, placements)
    if packet is aten.index_select:
        x, p = placements
        dim = _norm(argument(node, "dim"), _dims(args[0]))
        ok = _rows_of(x, dim, args[0], p) and len(_sizes(args[1])) == 1
        return Decision(Shard(dim), (x, p)) if ok else None
    if packet in (aten.index_add, aten.index_add_, aten.index_copy, aten.index_copy_, aten.index_fill,
                  aten.index_fill_):
        return _picked_write(node, args, placements)
    if packet in (aten.index_put, aten.index_put_):
        return _picked_put(node, args, placements)
    return None


def where_rows(node: fx.Node, args: list[fx.Node], placements: list) -> Decision | None:
    """``torch.where(mask)`` (``aten.where.default``: one tensor of indices per dimension) with ``mask`` split
    along its rows ``d``: its ``d``-th tensor numbers the part's own rows (:class:`Picked`), the others are the
    other coordinates of each selected entry, a part's selection (``Shard(0)``)."""
    p = placements[0]
    if not isinstance(p, Shard) or p.blocks > 1 or p.general or len(node.args) != 1:
        return None
    rows = _sizes(args[0])[p.dim]
    if not isinstance(rows, int):
        return None
    outs = tuple(Picked(0, rows) if k == p.dim else Shard(0) for k in range(_dims(args[0])))
    return Decision(outs, (p,))


def hit_rule(node: fx.Node, args: list[fx.Node], placements: list) -> Decision | None:
    """``greater(s, 0)`` of a sum over the rows (``s`` a partial sum) of values none negative, read only by a
    ``nonzero()`` whose every value the program asserts: the experts a batch hit, the same in every part
    (module docstring)."""
    if placements != [SUM] or argument(node, "other") != 0 or not _nonnegative_sum(args[0]):
        return None
    return Decision(R, (SUM,)) if _every_value_asserted(node) else None


def _picked_index(node, args, placements) -> Decision | None:
    """``x[..., rows, ...]`` with ``x`` split along the rows its numbers index; the other indices the selection's
    other coordinates (``routing_weights[top_x, idx]``), each as long as the numbers."""
    indices = list(node.args[1])
    x, xp = args[0], placements[0]
    place = dict(zip(args, placements, strict=True))
    if not isinstance(xp, Shard) or xp.dim >= len(indices) or indices[xp.dim] is None:
        return None
    numbers = indices[xp.dim]
    if not _rows_of(xp, xp.dim, x, place.get(numbers)):
        return None
    where = [d for d, i in enumerate(indices) if i is not None]
    for i in (indices[d] for d in where):
        if len(_sizes(i)) != 1 or not _same_size(i, numbers) or i is not numbers and place.get(i) != Shard(0):
            return None
    adjacent = where == list(range(where[0], where[0] + len(where)))
    return Decision(Shard(where[0] if adjacent else 0), tuple(placements))


def _picked_write(node, args, placements) -> Decision | None:
    """``x.index_add_(d, rows, src)`` (and ``index_copy``, ``index_fill``) along the rows of ``x`` its numbers
    index, ``src``'s entries the selection's (as many as the numbers) or one value for all."""
    x, xp, ip = args[0], placements[0], placements[1]
    dim = _norm(argument(node, "dim"), _dims(x))
    if not _rows_of(xp, dim, x, ip) or len(_sizes(args[1])) != 1:
        return None
    if len(args) > 2:
        src, sp = args[2], placements[2]
        if sp != Shard(dim) or not _same_size(src, args[1], dim, 0):
            return None
    return Decision(xp, tuple(placements))


def _picked_put(node, args, placements) -> Decision | None:
    """``x[rows, ...] = v`` / ``x.index_put_((rows, ...), v, accumulate)`` with ``x`` split along the rows its
    numbers index, the other indices and ``v`` the selection's (as many entries) or ``v`` one value for all."""
    indices, values = list(node.args[1]), node.args[2]
    place = dict(zip(args, placements, strict=True))
    xp = placements[0]
    if not isinstance(xp, Shard) or xp.dim >= len(indices) or indices[xp.dim] is None:
        return None
    numbers = indices[xp.dim]
    if not _rows_of(xp, xp.dim, args[0], place.get(numbers)):
        return None
    for i in indices:
        if i is not None and (len(_sizes(i)) != 1 or not _same_size(i, numbers)
                              or i is not numbers and place.get(i) != Shard(0)):
            return None
    vp = place.get(values, R) if isinstance(values, fx.Node) else R
    one = not isinstance(values, fx.Node) or all(s == 1 for s in _sizes(values))
    if vp == Shard(0) and _same_size(values, numbers) or vp == R and one:
        return Decision(xp, tuple(placements))
    return None


def _rows_of(xp, dim: int, x: fx.Node, numbers) -> bool:
    """Whether ``numbers`` (placed so) number the rows of ``x`` along ``dim``: ``x`` split there, as many rows."""
    return isinstance(numbers, Picked) and isinstance(xp, Shard) and xp == Shard(dim) and \
        _sizes(x)[dim] == numbers.rows


def _nonnegative_sum(s: fx.Node) -> bool:
    return getattr(s.target, "overloadpacket", None) is aten.sum and _nonnegative(s.args[0])


_SIGN_KEPT = {aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t, aten.squeeze,
              aten.unsqueeze, aten.expand, aten.clone, aten._to_copy, aten.to, aten.alias, aten.select, aten.slice,
              aten.flatten, aten.contiguous, aten.sum, aten.detach}
_NONNEGATIVE = {aten.one_hot, aten.abs, aten.relu, aten.exp, aten.sigmoid, aten.softmax, aten._softmax}


def _nonnegative(n, depth: int = 0) -> bool:
    """Whether every value of ``n`` is >= 0 by how it is made (a one-hot mask, a comparison, their products)."""
    if not isinstance(n, fx.Node):
        return isinstance(n, (int, float, bool)) and n >= 0
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
        return True
    packet = getattr(n.target, "overloadpacket", None)
    if depth > 32 or n.op != "call_function":
        return False
    if packet in _NONNEGATIVE:
        return True
    if packet in _SIGN_KEPT:
        return _nonnegative(n.args[0], depth + 1)
    if packet is aten.mul:
        return all(_nonnegative(a, depth + 1) for a in n.args[:2])
    return False


def _every_value_asserted(g: fx.Node) -> bool:
    """Whether ``g`` is read by a ``nonzero()`` alone, whose count the program asserts equal to a number and each
    of whose values (``unbind``'s rows, one number each) it asserts equal to one: specialized on the example batch
    at every read (:mod:`fxshard.capture.specialize`), so every part of the batch that runs holds its values."""
    users = list(g.users)
    if len(users) != 1 or users[0].target is not aten.nonzero.default or len(_sizes(g)) != 1:
        return False
    nz = users[0]
    count, rows = None, []
    for u in nz.users:
        if u.target is aten.sym_size.int and u.args[1] == 0:
            count = _asserted_value(u)
        elif u.target is aten.unbind.int and argument(u, "dim", 0) == 0:
            rows.extend(u.users)
        elif u.target is not aten.sym_size.int:
            return False
    if not isinstance(count, int) or len(rows) != count:
        return False
    return all(r.target is operator.getitem and any(_element_asserted(s) for s in r.users) for r in rows)


def _element_asserted(s: fx.Node) -> bool:
    """``row[0].item()`` asserted equal to a number (``select(row, 0, 0)``, then ``item``)."""
    if s.target is not aten.select.int or s.args[1:] != (0, 0):
        return False
    return any(u.target is aten.item.default and isinstance(_asserted_value(u), int) for u in s.users)


def _asserted_value(sym: fx.Node):
    """The number ``sym`` (a size or an ``item()``) is asserted equal to (``_assert_scalar(sym == k)``), or None."""
    for u in sym.users:
        if u.target is operator.eq and isinstance(u.args[1], int) and u.args[0] is sym and any(
                w.target is aten._assert_scalar.default for w in u.users):
            return u.args[1]
    return None


def _sizes(n: fx.Node) -> tuple:
    """``n``'s sizes: ints, or the symbol of a size the data decides."""
    out = []
    for s in n.meta["val"].shape:
        try:
            out.append(int(s))
        except (TypeError, ValueError, RuntimeError):
            out.append(s)
    return tuple(out)


def _dims(n: fx.Node) -> int:
    return n.meta["val"].dim()


def _same_size(a: fx.Node, b: fx.Node, da: int = 0, db: int = 0) -> bool:
    """Whether dimension ``da`` of ``a`` and ``db`` of ``b`` are one size: the same number, or the same symbol (the
    same selection's count)."""
    x, y = a.meta["val"].shape[da], b.meta["val"].shape[db]
    ex, ey = getattr(getattr(x, "node", None), "expr", x), getattr(getattr(y, "node", None), "expr", y)
    return str(ex) == str(ey)


def part_count(node: fx.Node, place: dict) -> fx.Node | None:
    """A number among ``node``'s arguments (not a size: ``x / rows.shape[0]``, not ``x.view(rows.shape[0], -1)``) that
    counts a split dimension of a size the data decides (a selection of a part's rows, ``place``: the placements
    decided so far), or None.  Each part would read its own count, not the whole batch's, and no gather makes it
    the whole's."""
    schema = getattr(node.target, "_schema", None)
    for a in schema.arguments if schema is not None else ():
        value = argument(node, a.name)
        if "int" in str(a.type) or "bool" in str(a.type) or not isinstance(value, fx.Node):
            continue
        if not isinstance(value.meta.get("val"), torch.Tensor) and _counts_part(value, place):
            return value
    return None


def _counts_part(n: fx.Node, place: dict, depth: int = 0) -> bool:
    if depth > 16 or n.op != "call_function":
        return False
    if n.target in (aten.sym_size.int, aten.sym_numel.default):
        p = place.get(n.args[0])
        split = p.dim if isinstance(p, (Shard, Picked)) else None
        if split is None or not isinstance(_sizes(n.args[0])[split], torch.SymInt):
            return False
        return n.target is aten.sym_numel.default or n.args[1] % _dims(n.args[0]) == split
    return any(not isinstance(a.meta.get("val"), torch.Tensor) and _counts_part(a, place, depth + 1)
               for a in n.all_input_nodes)


def averages_selection(args: list[fx.Node], placements: list) -> bool:
    """Whether an op whose parts' results average to the whole's (``Partial("avg")``) reads first a value split
    along a size the data decides (a selection of the rows): parts of 10 and 30 entries would weigh alike."""
    if not args or not isinstance(placements[0], (Shard, Picked)):
        return False
    return isinstance(_sizes(args[0])[placements[0].dim], torch.SymInt)


def masked_scatter_rule(node: fx.Node, args: list[fx.Node], placements: list) -> Decision | None:
    """``x.masked_scatter(mask, source)`` with ``x`` and ``mask`` split along their rows and ``source`` along its
    first dimension (Llava's image features into its image tokens): the source's entries go to the mask's places in
    order, so each part takes its own entries exactly when its mask counts as many places as its source has
    entries.  The rule holds only where the program asserts that of each part (:func:`_count_asserted`)."""
    if len(args) != 3 or any(p != Shard(0) for p in placements):
        return None
    x, mask, source = args
    if _dims(mask) != _dims(x) or not _count_asserted(mask, source, _numel(x) // max(_numel(mask), 1)):
        return None
    return Decision(Shard(0), tuple(placements))


def _count_asserted(mask: fx.Node, source: fx.Node, inner: int) -> bool:
    """Whether the program asserts ``mask.sum() * inner == source.numel()`` (or ``sum() == numel``), the sum of the
    boolean ``mask`` reads before it is shaped for the scatter (``unsqueeze``, ``to``, ``expand``)."""
    flags = {mask}
    m = mask
    while getattr(m.target, "overloadpacket", None) in (aten.unsqueeze, aten._to_copy, aten.to, aten.expand,
                                                          aten.view, aten.reshape):
        m = m.args[0]
        flags.add(m)
    total = _numel(source)
    for flag in flags:
        for s in flag.users:
            if s.target is not aten.sum.default:
                continue
            for c in [s, *s.users]:
                k = 1 if c is s else c.args[1] if c.target is aten.mul.Tensor and c.args[0] is s else None
                if k not in (1, inner) or (k == 1) != (c is s):
                    continue
                if any(e.target is aten.eq.Scalar and e.args[0] is c and e.args[1] == total and asserted_true(e)
                       for e in c.users):
                    return True
    return False


def asserted_true(node: fx.Node) -> bool:
    """Whether the program asserts the boolean ``node`` True (``torch._check``, ``torch_compilable_check``, a branch
    the example batch took: ``sym_ite(item, 1, 0) == 1``).  Parts of the batch whose sums each equal their count
    sum to the whole's; parts that each differ may not differ as a whole (sums 2 and 6 against 4 each, 8 against
    8): a branch not taken on every part may be taken on one device."""
    for u in node.users:
        if u.target is aten._is_all_true.default and asserted_true(u):
            return True
        if u.target is not aten.item.default:
            continue
        for w in u.users:
            if w.target is aten._assert_scalar.default:
                return True
            if getattr(w.target, "__name__", "") == "sym_ite" and w.args[1:] == (1, 0) and any(
                    c.target in (operator.eq, operator.ge) and c.args == (w, 1) and any(
                        a.target is aten._assert_scalar.default for a in c.users) for c in w.users):
                return True
    return False


def _numel(n: fx.Node) -> int:
    out = 1
    for s in _sizes(n):
        out *= s if isinstance(s, int) else 0
    return out
