"""Which dimension of each value carries the examples of the batch, and which ops mix them: the batch-row analysis.

Data parallelism, pipeline microbatches and ``--grad-accum`` run the captured program on a part of the step's
rows (``b`` of them).  That equals single-device training only where every value's row r is computed from input
row r alone.  A reshape across batch and sequence (a router's ``view(2, B*S, -1)``), flattened rows split at
another size, a sum over the batch fed back into the rows, a sort or a cumulative sum over the batch: each gives
a rank other numbers than its rows of the single-device ones, silently.

Export bakes sizes into the graph, so, as :mod:`fxshard.ir.sequence` finds the sequence, the model is captured a
second time at twice the rows, and that program is decided by the placement rules split in two parts along its
batch (the tensor-parallel table, :mod:`fxshard.ir.cp_rules` for losses and partial sums, and
:mod:`fxshard.ir.rows_rules` for what only the batch meets): ``Shard(d)`` (dimension d holds the examples, each
part its own), ``Replicate`` (the same in every part: the weights and what the batch does not enter),
``Partial("sum"|"avg")`` (a sum or mean over the batch, which the parts add up or average to, as the loss).  The
split must be the captured program: each part of a value must have the shape captured at ``b`` rows.  An op no rule
computes on the split, or whose shapes break it, mixes rows: it needs the whole batch (``passes/batch_rows.py``
gathers its operands under ``--dp``; pipeline microbatches and ``--grad-accum`` refuse it, naming it)::

    rows = batch_rows(program.gm, twice.gm, user_inputs, "model.py")
    rows.place["view_3"], rows.mixing["view_3"]   # (None, 'model.mlp.router: aten.view.default ... ')

A value computed on the whole batch is taken back to its part (``rt.own_rows``) where it has one dimension that
follows the batch; the analysis goes on from there, so one mixing op costs one gather, not the rest of the model.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from fxshard.graph import model_line, node_fqn
from fxshard.ir.cp_experts import BLOCK_OPS, TokenBlock, token_local_blocks
from fxshard.ir.cp_rules import cp_rule
from fxshard.ir.experts import ROW_OPS, grouped_mm_ops, offsets, reaches
from fxshard.ir.placement import Partial, Replicate, Shard, local_shape
from fxshard.ir.rows_picked import Picked, asserted_true, averages_selection, part_count
from fxshard.ir.rows_rules import FRESH, RATIO, SOURCES, UNIFORM, Ids, only_asserted, rows_rule
from fxshard.ir.sharding import Decision, argument, rule_decision, tensor_args
from fxshard.ir.token_means import counted_terms
from fxshard.ir.twins import Pairing, op_name, pair_nodes

aten = torch.ops.aten
R = Replicate()
AVG = Partial("avg")
PARTS = 2  # the second capture holds twice the rows: two parts
_WHOLE = object()  # a decision: computed on the whole batch, as an input is


@dataclass(frozen=True)
class BatchRows:
    """The analysis of a program captured at ``rows`` rows: per node name, the placement of its value over the
    batch (``place``: None where only the whole batch's value exists), the ops that need the whole batch and why
    (``mixing``), the nodes computed on the whole batch (``whole``: those and what follows from them without a
    part), and for those, each integer argument at ``rows`` and at twice as many (``sizes``), from which their sizes
    at the whole batch follow."""

    rows: int
    place: dict[str, object] = field(default_factory=dict)
    mixing: dict[str, str] = field(default_factory=dict)
    whole: tuple[str, ...] = ()
    sizes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    handled: frozenset[str] = frozenset()  # computed on the whole batch by another pass (batch norm, contrastive)
    ratios: tuple[str, ...] = ()  # scalar ratios of two sums over the batch (rows_rules.RATIO): averaged over parts
    loss: object = None  # the loss's placement (the first output): P(avg) for a mean, P(sum) for a sum over the batch
    checks: dict[str, str] = field(default_factory=dict)  # reads of a value over the rows no split can check: why

    @property
    def acts(self) -> bool:
        """Whether the program needs more than its rows (an op mixing them, a ratio of sums, a summed loss) or
        cannot be split (``checks``)."""
        return bool(self.whole or self.ratios or self.mixing or self.checks) or self.loss == Partial("sum")

    def of(self, node: fx.Node):
        """``node``'s placement over the batch (``Replicate`` for a node the passes inserted)."""
        return self.place.get(node.name, R)

    def pairs_rows(self, left: fx.Node, right: fx.Node) -> bool:
        """Whether ``left @ right`` pairs each example's row with every example's column (a contrastive product)."""
        return self.place.get(left.name) == Shard(0) and self.place.get(right.name) == Shard(1)

    def rows_dim(self, node: fx.Node) -> Shard | None:
        """The split of ``node``'s value along its rows, or None (the same in every part, or whole only)."""
        p = self.place.get(node.name)
        return p if isinstance(p, Shard) else None


def batch_rows(g1: fx.GraphModule, g2: fx.GraphModule, user_inputs: set[str], where: str,
               handled: set[str] = frozenset(), exempt: dict[str, object] | None = None) -> BatchRows:
    """Decide every value of ``g2`` (the program at twice the rows of ``g1``) split in two along its batch, checked
    against ``g1``'s shapes.  ``user_inputs``: the names of the batch's inputs; ``handled``: nodes another pass
    computes on the whole batch (their value counts as whole); ``exempt``: nodes whose placement another pass
    decides (a synchronized batch norm keeps its rows)."""
    pairing = pair_nodes(g1, g2, where)
    walk = _Walk(pairing, user_inputs, set(handled), exempt or {}, where)
    walk.guards = guard_only(g2)
    out2 = next(n for n in g2.graph.nodes if n.op == "output").args[0]
    if isinstance(out2, (tuple, list)) and isinstance(out2[0], fx.Node):  # means the token-mean pass makes exact
        walk.counted = {n for n, _, _ in counted_terms(out2[0], {n for n in g2.graph.nodes if n.name in user_inputs})}
    for node in g2.graph.nodes:
        one = walk.one_of.get(node)
        if one is not None:
            walk.decide(node, one)
        elif node in pairing.extra and walk.one_of.get(node.args[0]) is not None:
            walk.decide(node, walk.one_of[node.args[0]], extra=True)  # a no-op at the rows: valued as its input
    place: dict[str, object] = {}
    whole = []
    for one in g1.graph.nodes:
        if one in pairing.twin:
            place[one.name] = walk.place.get(pairing.twin[one], R)
            if pairing.twin[one] in walk.whole:
                whole.append(one.name)
        elif one in pairing.same_as:  # a no-op at twice the rows: its input's placement
            place[one.name] = place.get(pairing.same_as[one].name, R)
            if place[one.name] is None:
                whole.append(one.name)
    rows = _rows(g1, user_inputs)
    out = next(n for n in g1.graph.nodes if n.op == "output").args[0]
    loss = place.get(out[0].name) if isinstance(out, (tuple, list)) and isinstance(out[0], fx.Node) else None
    return BatchRows(rows, place, walk.mixing, tuple(whole), walk.sizes, frozenset(handled), tuple(walk.ratios), loss,
                     walk.checks)


def _rows(gm: fx.GraphModule, user_inputs) -> int:
    """The batch's rows in ``gm``: its first batched user input's leading size (0 where none has one)."""
    return next((int(n.meta["val"].shape[0]) for n in gm.graph.nodes if n.name in user_inputs
                 and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()), 0)


def _split_rows(pairing: Pairing, user_inputs) -> int:
    """The batch's rows: the leading size of a user input that has twice as many at twice the rows (not a
    ``position_ids`` of ``[1, S]``, the same in both captures); 0 where none has."""
    for one, node in pairing.twin.items():
        a, b = one.meta.get("val"), node.meta.get("val")
        if one.op == "placeholder" and one.name in user_inputs and isinstance(a, torch.Tensor) and \
                isinstance(b, torch.Tensor) and a.dim() and b.dim() and _int(b.shape[0]) == 2 * _int(a.shape[0]):
            return int(a.shape[0])
    return 0


def guard_only(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose value reaches nothing but runtime assertions (``aten._assert_scalar``): the reads
    capture specialized on the example batch (:mod:`fxshard.capture.specialize`), checked against it, never
    computed with."""
    found: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "call_function" and node.users and all(
                u.target is aten._assert_scalar.default or u in found for u in node.users):
            found.add(node)
    return found


class _Walk:
    def __init__(self, pairing: Pairing, user_inputs, handled, exempt, where: str):
        self.one_of = {node: one for one, node in pairing.twin.items()}
        self.rows = _split_rows(pairing, user_inputs)
        self.user_inputs, self.handled, self.exempt, self.where = user_inputs, handled, exempt, where
        self.place: dict[fx.Node, object] = {}
        self.mixing: dict[str, str] = {}
        self.whole: set[fx.Node] = set()
        self.sizes: dict[str, list[tuple[int, int]]] = {}
        self.ratios: list[str] = []
        g2 = next(iter(self.one_of)).graph.owning_module if self.one_of else None
        self.blocks = {n: b for b in token_local_blocks(g2, node_fqn) for n in b.nodes} if g2 is not None else {}
        self.blocks_why: dict[str, str] = {}
        self.guards: set[fx.Node] = set()
        self.checks: dict[str, str] = {}
        self.counted: set[fx.Node] = set()

    def decide(self, node: fx.Node, one: fx.Node, extra: bool = False) -> None:
        self.extra = extra
        if node.op == "placeholder":
            self.place[node] = self._input(node, one)
        elif node.op == "call_function":
            self._call(node, one)
            pairs = _int_pairs(one, node) if not extra else []
            if any(a != b for a, b in pairs):  # sizes that follow the batch: the whole batch's follow from them
                self.sizes[one.name] = pairs

    def _input(self, node: fx.Node, one: fx.Node):
        val = node.meta.get("val")
        if node.name not in self.user_inputs or not isinstance(val, torch.Tensor) or val.dim() == 0:
            return R
        return Shard(0) if _consistent(node, one, Shard(0)) else None

    def _call(self, node: fx.Node, one: fx.Node) -> None:
        if node.target is operator.getitem:
            src = self.place.get(node.args[0], R)
            self.place[node] = src[node.args[1]] if isinstance(src, tuple) else src
            if node.args[0] in self.whole:
                self.whole.add(node)
            return
        if one.name in self.exempt and not self.extra:
            self.place[node] = self.exempt[one.name]
            return
        if one.name in self.handled and not self.extra:
            self.place[node] = _part_of_whole(node, one)
            return
        args = tensor_args(node)
        has = [self.place.get(a) for a in args]  # a value the captured program does not have: whole only
        numbers = _numbers(node, one) if args and getattr(node.target, "overloadpacket", None) not in FRESH else []
        if numbers and not _mean_by_count(node, has, numbers):
            name, a, b = numbers[0]
            return self._whole(node, one, f"its argument {name} = {a} follows the batch ({b} at twice the rows): "
                                          "the part's batch size used as a number")
        count = part_count(node, self.place)
        if count is not None and not self.extra:
            return self._count_read(node, one, count)
        try:
            decision = Decision(AVG, tuple(has)) if numbers else self._decision(node, one, args, has)
        except GuardOnDataDependentSymNode:  # a rule read a size the data decides
            decision = None
        if decision is _WHOLE:
            return self._whole(node, one, "")
        why = self._refusal(node, one, args, has, decision)
        if why:
            return self._whole(node, one, why)
        if _avg(decision) == AVG and not numbers and node not in self.counted and not self.extra and \
                averages_selection(args, has):
            return self._refuse(node, one, "averages a selection of the batch's rows (a count the data decides): the "
                                           "parts' means would weigh each part alike, one device weighs each entry")
        self.place[node] = _avg(decision)
        if node in self.guards and not self.extra and isinstance(self.place[node], Partial) and any(
                u.target in _READS for u in node.users):
            return self._check(node, one)  # int(mask.sum()): each part reads its own part of the value
        if decision.rewrite == RATIO and not self.extra:
            self.ratios.append(one.name)

    def _decision(self, node, one, args, has):
        if node in self.blocks:
            return self._token_block(node, args, has)
        if any(h is None for h in has):  # a value only the whole batch has: this op runs on the whole batch
            return _WHOLE
        if all(h == R for h in has) or getattr(node.target, "overloadpacket", None) in FRESH:
            return self._source(node, one)  # its value is not the inputs' values: its size alone
        if any(isinstance(h, (Ids, Picked)) for h in has) or node.target is aten.where.default and len(
                node.args) == 1:  # row numbers, nonzero's: only the batch's rules read them
            return rows_rule(node, args, has)
        return rows_rule(node, args, has) or cp_rule(node, args, has) or rule_decision(node, args, has)

    def _source(self, node: fx.Node, one: fx.Node) -> Decision | None:
        """An op of values the batch does not enter: the same in every part, unless its size follows the batch (a
        ``zeros(B, S)``, an ``expand`` of a weight over the rows, a draw of ``rand(B, L)``: its part along that
        dimension; an ``arange(B)``: the part's row numbers)."""
        out = _replicated(node)
        if _consistent(node, one, out):
            return Decision(out, tuple(self.place.get(a) for a in tensor_args(node)))
        grown = _grown_dims(node, one)
        if not isinstance(node.meta.get("val"), torch.Tensor) or len(grown) != 1:
            return None
        d = grown[0]
        if node.target is aten.arange.default and node.meta["val"].dim() == 1:
            return Decision(Ids(0), ())
        if getattr(node.target, "overloadpacket", None) in UNIFORM or node.target in SOURCES or \
                _tiled(node, one, d, self.rows):
            return Decision(Shard(d), tuple(self.place.get(a) for a in tensor_args(node)))
        return None

    def _token_block(self, node, args, has) -> Decision | None:
        """An experts module's op (:mod:`fxshard.ir.cp_experts`): the module as a whole gives each token its own
        rows, so its ops keep the token rows split as its inputs are, and the rest whole."""
        block = self.blocks[node]
        why = not_row_local(block, lambda n: _grown_dims(n, self.one_of.get(n)))
        if why is not None:
            self.blocks_why[block.fqn] = why
            return None
        out = Shard(0) if 0 in _grown_dims(node, self.one_of[node]) else R
        val = node.meta.get("val")
        return Decision(tuple(out for _ in val) if isinstance(val, (tuple, list)) else out, tuple(has))

    def _count_read(self, node: fx.Node, one: fx.Node, count: fx.Node) -> None:
        """``node`` uses the count of a selection of the part's rows as a number (:func:`part_count`): refused."""
        self._refuse(node, one, f"uses {count.name}, the count of a selection of the batch's rows (a size the data "
                                "decides), as a number: each part of the batch would use its own count, not the whole "
                                "batch's")

    def _refuse(self, node: fx.Node, one: fx.Node, why: str) -> None:
        """``node`` cannot be computed on the parts, nor on the whole batch (its operands' sizes differ per part,
        which no gather over the ranks takes): the compile is refused under a split batch, naming it."""
        self.place[node] = None
        self.whole.add(node)
        line = model_line(node)
        self.checks[one.name] = f"{node_fqn(node) or 'model'}: {op_name(node)} ({one.name}" + (
            f", {line}" if line else "") + f") {why}"

    def _refusal(self, node, one, args, has, decision) -> str:
        """Why ``decision`` does not compute ``node`` on each part's rows as captured ("" when it does)."""
        if decision is None and any(isinstance(h, Picked) for h in has):
            return ("it reads the numbers of rows torch.where picked from the batch's rows other than to index, look "
                    "up or write back the rows they number (the same rows: fxshard.ir.rows_picked), and a part's "
                    "numbers are not the whole batch's")
        if decision is None:
            partial = next((a for a, h in zip(args, has, strict=True) if isinstance(h, Partial)), None)
            if partial is not None and any(isinstance(h, Shard) for h in has):
                return (f"it reads {partial.name}, a sum or mean over the batch, beside the rows: each row needs the "
                        "whole batch's")
            return "no rule computes it on a part of the batch"
        for a, h, need in zip(args, has, decision.inputs, strict=True):
            if h != need:
                return (f"it needs {a.name} as {_text(need)} where it is {_text(h)}: "
                        + ("a sum over the batch used as a whole" if isinstance(h, Partial)
                           else "the values of other rows"))
        if not _consistent(node, one, _avg(decision)):
            return (f"its value at twice the rows ({_shape(node)}), split in {PARTS}, is not the captured "
                    f"{_shape(one)}: a size in it does not follow the batch")
        return ""

    def _whole(self, node: fx.Node, one: fx.Node, why: str) -> None:
        if node in self.guards and not self.extra:
            return self._check(node, one)
        self.whole.add(node)
        name = f"{node.name} (at twice the rows)" if self.extra else one.name
        if why:
            self.mixing[name] = (f"{node_fqn(node) or 'model'}: {op_name(node)} ({name}"
                                 + (f", {model_line(node)}" if model_line(node) else "") + f") mixes the rows "
                                 f"of the batch: {why}")

        self.place[node] = _part_of_whole(node, one)


    def _check(self, node: fx.Node, one: fx.Node) -> None:
        """A value over the rows that only a runtime check reads (specialized data-dependent code: each part's
        program checks that its rows give the example batch's value).  A maximum, minimum, any or all over the
        rows gives the whole batch every part's value when the parts agree: one device takes the branch each part
        takes, and the value is the same in every part that runs on.  A sum over the rows asserted equal to a
        count that follows the batch (Llava's image tokens against its image features: each part's count of each)
        holds on the whole batch when it holds on every part.  Any other (a count, a sum) may give the whole batch
        another value than every part's: refused, naming the read."""
        has = [self.place.get(a) for a in tensor_args(node)]
        if getattr(node.target, "overloadpacket", None) in _SELECTING and all(
                isinstance(h, Shard) or h == R for h in has) and _lone_scalar_check(node):
            self.place[node] = R
            return
        if node.target is aten.eq.Scalar and has == [Partial("sum")] and _lone_scalar_check(node) and \
                asserted_true(node) and argument(node, "other") == PARTS * argument(one, "other"):
            self.place[node] = R
            return
        self.place[node] = R
        if any(a in self.whole or a.name in self.checks for a in tensor_args(node)):
            return
        line = model_line(node)
        self.checks[one.name] = (
            f"{node_fqn(node) or 'model'}: {op_name(node)} ({one.name}{', ' + line if line else ''}) computes a value "
            "over the rows of the batch that data-dependent code reads (specialized on the example batch, checked "
            "on each part's rows): the whole batch may read another value than every part does, so a split batch "
            "would take another branch than one device")


_SELECTING = {aten.max, aten.min, aten.amax, aten.amin, aten.any, aten.all}
_READS = {aten.item.default, aten._local_scalar_dense.default}  # a tensor's value read as a Python number


def _lone_scalar_check(node: fx.Node) -> bool:
    """Whether ``node`` is one value (0-dim: not ``amax(dim=0)``'s vector, not ``max.dim``'s row indices) that
    reaches its assertions alone, through ops of it and constants only.  Combined with another value on the way
    (``lengths.min() == lengths.max()``, ``(lengths == lengths.max()).all()``) the parts' agreement no longer
    gives the whole batch's value: parts of lengths [3, 3] and [5, 5] each read True, the whole reads False."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0 and only_asserted(node)


def _tiled(node: fx.Node, one: fx.Node, d: int, rows: int) -> bool:
    """``x.repeat(...)`` of a value the batch does not enter, tiled along ``d`` so that every row of the batch gets
    the same whole copies of ``x``: a one-row ``x`` (a mask token over the batch), a new leading dimension, or a
    repeat count along ``d`` that is a multiple of the batch's rows (DeBERTa's relative-position keys ``[H, 2L, dh]``
    repeated to ``[B*H, 2L, dh]``).  A part of the batch then repeats the same copies over its own rows.  Not when a
    row holds part of a copy (``w[:2].repeat(3 * B // 2, 1)``: odd rows start at ``w[1]``)."""
    if node.target is not aten.repeat.default:
        return False
    src = node.args[0].meta["val"]
    k = d - (node.meta["val"].dim() - src.dim())
    if k < 0 or src.shape[k] == 1:
        return True
    count = _int(list(one.args[1])[d]) if len(one.args) > 1 else None
    return rows > 0 and count is not None and count % rows == 0


def _per_row(node: fx.Node) -> bool:
    """An op computing each row of its result from that row alone: an experts module's row-wise ops, anything
    elementwise (a bias added in place), a slice of the columns (GPT-OSS's interleaved gate and up)."""
    if node.target in ROW_OPS or node.target is operator.getitem:
        return True
    if node.target is aten.slice.Tensor:
        return argument(node, "dim") % node.args[0].meta["val"].dim() != 0
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags or \
        node.target in (aten.add_.Tensor, aten.mul_.Tensor, aten.clamp_.default)


def not_row_local(block: TokenBlock, follows) -> str | None:
    """Why an experts module may compute a row of the batch from another's (None: each token's result is its
    own): :meth:`TokenBlock.not_token_local` for the batch's rows, where the ops between the grouped matmuls and
    around them may be any op acting on each row alone (:func:`_per_row`)."""
    if len(block.mms) != 2:
        return f"{len(block.mms)} grouped matmuls (expected two: gate/up, then down)"
    first, second = block.mms
    if offsets(first) is not offsets(second):
        return f"grouped matmuls {first.name} and {second.name} with different expert offsets"
    mms = grouped_mm_ops()
    after = {first}
    for n in block.nodes:  # graph order: what the first matmul's rows reach
        if n is not first and any(a in after for a in n.all_input_nodes):
            after.add(n)
    between = {n for n in after if n not in (first, second) and reaches(n, second)}
    for n in block.nodes:
        if n in between and not _per_row(n):
            return f"{n.name} ({n.target}) between the experts' grouped matmuls is not an op known to act row by row"
        if n.target not in BLOCK_OPS and n.target not in mms and not _per_row(n):
            return f"{n.name} ({n.target}), not an op of the experts' sort, dispatch, matmuls and combine"
        if n.target is aten.arange.default and len(n.args) != 1:
            return f"{n.name} ({n.target}) with a start or step"
    for n in block.outputs:
        if 0 not in follows(n):
            return f"its output {n.name} has no token rows (dimension 0 does not follow the batch)"
    return None


def _numbers(node: fx.Node, one: fx.Node) -> list[tuple[str, object, object]]:
    """The numbers among ``node``'s arguments (not sizes or dimensions) that differ from ``one``'s: ``(name, at the
    captured rows, at twice as many)``; a size of the batch a model uses as a value (``h.sum(0) / h.shape[0]``)."""
    schema = getattr(node.target, "_schema", None)
    found = []
    for a in schema.arguments if schema is not None else ():
        if "int" in str(a.type) or "bool" in str(a.type):
            continue
        x, y = argument(one, a.name), argument(node, a.name)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool) and x != y:
            found.append((a.name, x, y))
    return found


def _mean_by_count(node: fx.Node, has: list, numbers: list) -> bool:
    """``part of a sum / its count`` where the count is the part's (twice at twice the rows): the parts' values
    average to the whole's mean."""
    return (node.target in (aten.div.Tensor, aten.div.Scalar) and has == [Partial("sum")]
            and len(numbers) == 1 and numbers[0][0] == "other" and numbers[0][2] == PARTS * numbers[0][1])


def _part_of_whole(node: fx.Node, one: fx.Node):
    """The placement a value computed on the whole batch is taken back to: its part along the one dimension that
    follows the batch (``rt.own_rows``), the whole value where none does (the same on every rank), else None."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(_part_of(v, w) for v, w in zip(val, one.meta.get("val"), strict=True))
    return _part_of(val, one.meta.get("val"))


def _part_of(v, w):
    if not isinstance(v, torch.Tensor) or not isinstance(w, torch.Tensor) or v.dim() != w.dim():
        return R
    sizes = [(_int(a), _int(b)) for a, b in zip(v.shape, w.shape, strict=True)]
    if any(a is None or b is None for a, b in sizes):
        return None
    grown = [d for d, (a, b) in enumerate(sizes) if a != b]
    if not grown:
        return R
    if len(grown) == 1 and sizes[grown[0]][0] == PARTS * sizes[grown[0]][1]:
        return Shard(grown[0])
    return None


def _consistent(node: fx.Node, one: fx.Node, out) -> bool:
    """Whether ``out`` over ``PARTS`` parts of ``node``'s value (at twice the rows) gives ``one``'s shape."""
    val, want = node.meta.get("val"), one.meta.get("val")
    if isinstance(val, (tuple, list)):
        outs = out if isinstance(out, tuple) else tuple(out for _ in val)
        return isinstance(want, (tuple, list)) and len(want) == len(val) and all(
            _consistent_value(v, w, o) for v, w, o in zip(val, want, outs, strict=True))
    return _consistent_value(val, want, out)


def _consistent_value(val, want, out) -> bool:
    if not isinstance(val, torch.Tensor):
        return not isinstance(want, torch.Tensor)
    if not isinstance(want, torch.Tensor) or val.dim() != want.dim():
        return False
    full = [_int(s) for s in val.shape]
    got = [_int(s) for s in want.shape]
    if isinstance(out, (Ids, Picked)):
        out = Shard(out.dim)
    if isinstance(out, Shard):
        if full[out.dim] is None:
            return all(a == b for d, (a, b) in enumerate(zip(full, got, strict=True)) if d != out.dim)
        if any(s is None for s in full) or not out.divides(full[out.dim], PARTS):
            return False
        full = list(local_shape(tuple(full), out, PARTS))
    return all(a == b or a is None or b is None for a, b in zip(full, got, strict=True))


def _grown_dims(node: fx.Node, one: fx.Node | None) -> tuple[int, ...]:
    """The dimensions of ``node``'s value whose size differs from ``one``'s: those that follow the batch."""
    v, w = node.meta.get("val"), one.meta.get("val") if one is not None else None
    if isinstance(v, (tuple, list)) and isinstance(w, (tuple, list)) and v and w:  # a sort's values and indices
        v, w = v[0], w[0]
    if not isinstance(v, torch.Tensor) or not isinstance(w, torch.Tensor) or v.dim() != w.dim():
        return ()
    return tuple(d for d in range(v.dim()) if _int(v.shape[d]) != _int(w.shape[d]))


def _int_pairs(one: fx.Node, node: fx.Node) -> list[tuple[int, int]]:
    """Each number among the arguments of ``one`` (captured rows) beside ``node``'s (twice as many), in pytree
    order."""
    a = [x for x in pytree.tree_leaves((one.args, one.kwargs)) if type(x) in (int, float)]
    b = [x for x in pytree.tree_leaves((node.args, node.kwargs)) if type(x) in (int, float)]
    return list(zip(a, b, strict=True)) if len(a) == len(b) else []


def _avg(decision: Decision):
    """A decision's output over the batch: the tensor-parallel table's mean over the split dimension
    (``mean_of_parts``) is the parts' average."""
    if decision.rewrite == "mean_of_parts":
        return Partial("avg")
    return decision.out


def _replicated(node: fx.Node):
    val = node.meta.get("val")
    return tuple(R for _ in val) if isinstance(val, (tuple, list)) else R


def _int(s) -> int | None:
    try:
        return int(s)
    except (TypeError, ValueError, RuntimeError):
        return None


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    return str(list(val.shape)) if isinstance(val, torch.Tensor) else type(val).__name__


def _text(p) -> str:
    return "whole" if p is None else str(p)


