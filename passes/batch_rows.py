"""Ops that mix the rows of the batch (:mod:`fxshard.ir.rows`) under ``--dp``: computed on the whole batch.

A dp rank runs the program on its own rows.  Where an op's row depends on other rows (a router's
``view(2, B*S, -1)``, a sort or a cumulative sum over the batch, flattened rows split at another size), each rank
would compute other numbers than one device, silently (a decoder LM with such a router was 2.1e-4 off at --dp 2).
This pass computes each such op on the whole batch, on every rank: its operands' parts are all-gathered over dp
(``rt.gather_to``, whose backward sums every rank's gradient and keeps this rank's part), a sum over the batch is
summed over the ranks the same way, the sizes that follow the batch become the whole batch's (from the two captures
of the analysis), and the result is taken back to this rank's rows (``rt.own_rows``) where it has them::

    gather_to = rt.gather_to(linear, self.dp, dim=0)                 # [B*S, E]: every rank's tokens
    view = torch.ops.aten.view.default(gather_to, [2, 64, 2])        # the whole batch's view
    ...
    own_rows = rt.own_rows(view_1, self.dp, dim=0)                   # [b*S, E]: this rank's tokens again

Each rank's loss is then its part of one device's, and the gradients are one device's: a rank's gradient of a value
computed whole reaches every rank's rows through the gather's reduce-scatter, which the data-parallel average of the
weights' gradients divides back (as ``passes/batch_gather.py`` does for a contrastive loss, whose products it
computes; this pass leaves them to it).

Pipeline microbatches cannot be made exact (a schedule runs microbatch 0 before the rest of the batch exists): the
compile is refused, naming each op, its module and the model's line; ``--grad-accum`` is refused at launch for the
same reason (the manifest's batch couplings).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from fxshard.errors import LayoutError
from fxshard.graph import model_line, node_fqn
from fxshard.ir.context import DP, CompileContext, Group, spec
from fxshard.ir.placement import Partial, Replicate, Shard
from fxshard.ir.rows import BatchRows
from fxshard.ir.rows_picked import Picked
from fxshard.ir.rows_rules import Ids
from fxshard.ir.sharding import tensor_args
from fxshard.runtime import collectives as rtc

aten = torch.ops.aten


def batch_rows_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    rows: BatchRows = ctx.rows
    found = list(rows.mixing.values())
    if rows.checks:
        raise LayoutError(_checks_refusal(ctx, list(rows.checks.values())))
    ctx.batch_couplings = [*ctx.batch_couplings, *(f"{_site(f)} (mixes the rows of the batch)" for f in found)]
    if found and ctx.microbatches > 1:
        raise LayoutError(_refusal(ctx, found))
    if rows.ratios and (ctx.microbatches > 1 or ctx.layout.dp == 1):
        ctx.notes.append(f"{', '.join(rows.ratios)}: a ratio of two sums over the batch (a loss over a mask's count), "
                         f"averaged over the {ctx.microbatches} microbatches: the single-device ratio when every "
                         "microbatch counts alike (as an MAE's masked patches), not otherwise")
    _summed_loss(gm, ctx)
    if ctx.layout.dp == 1 or ctx.microbatches > 1:
        gm.recompile()
        return gm
    whole = _Whole(gm, rows, ctx.layout.dp)
    names = set(rows.whole) | set(rows.ratios)
    nodes = [n for n in gm.graph.nodes if n.name in names]
    lost = names - {n.name for n in nodes}
    if lost:  # an earlier pass replaced it: computed on the rows, it would be wrong
        raise LayoutError(f"--dp {ctx.layout.dp}: {', '.join(sorted(lost))} must be computed on the whole batch, and "
                          "an earlier pass rewrote it (a tensor-parallel or loss rewrite); train at --dp 1, or at "
                          "--tp 1")
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and (node.name in names or whole.carries(node)):
            whole.compute(node)
    whole.take_back()
    whole.revalue()
    ctx.rows = dataclasses.replace(rows, whole=tuple(n.name for n in whole.whole))  # for the draws' and masks' rows
    ctx.notes.append(f"--dp {ctx.layout.dp}: {len(found) + len(rows.ratios)} op(s) mix the rows of the batch ("
                     + "; ".join([_site(f) for f in found] + [f"{r} (a ratio of two sums)"
                                                                                  for r in rows.ratios])
                     + "): computed on the whole batch on every rank (their operands gathered over dp, rt.gather_to; "
                     "the rows taken back, rt.own_rows): the values and gradients of one device")
    gm.graph.lint()
    gm.recompile()
    return gm


def _summed_loss(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """A loss that sums over the batch (``reduction="sum"``): each part's is its share of the sum, which training
    averages over the dp ranks and microbatches; times their number, the average is the sum (cp does the same
    over its ranks, passes/context_parallel.py)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0][0]
    if not isinstance(loss, fx.Node) or ctx.rows.of(loss) != Partial("sum"):
        return
    parts = ctx.layout.dp * ctx.microbatches
    with gm.graph.inserting_before(out):
        scaled = gm.graph.call_function(aten.mul.Tensor, (loss, float(parts)))
    scaled.meta = {"val": loss.meta.get("val"), "nn_module_stack": loss.meta.get("nn_module_stack", {}),
                   "fxshard": dataclasses.replace(spec(loss), collective="", inputs=(spec(loss).placement,),
                                                  role="a sum over the batch: times the parts training averages")}
    out.args = ((scaled, *out.args[0][1:]),) + out.args[1:]
    ctx.notes.append(f"the loss sums over the batch: each of the {parts} parts' sums is multiplied by {parts}, so "
                     "the average training takes over dp ranks and microbatches is the sum of one device")


def _site(found: str) -> str:
    """``module: op (node, model.py:12)`` of the analysis' why."""
    return found.split(" mixes the rows")[0]


def _checks_refusal(ctx: CompileContext, found: list[str]) -> str:
    split = " and ".join(([f"--dp {ctx.layout.dp}"] if ctx.layout.dp > 1 else [])
                         + ([f"{ctx.microbatches} microbatches"] if ctx.microbatches > 1 else []))
    more = f"; and {len(found) - 1} more: " + "; ".join(f.split(" computes a value")[0] for f in found[1:]) \
        if len(found) > 1 else ""
    return (f"{split}: {found[0]}{more}. Train it without splitting the batch (--tp, --dp 1, --pp 1), or make the "
            "code depend on shapes, the config, or each row alone")


def _refusal(ctx: CompileContext, found: list[str]) -> str:
    more = f"; and {len(found) - 1} more: " + "; ".join(_site(f) for f in found[1:]) if len(found) > 1 else ""
    return (f"--pp {ctx.layout.pp} with {ctx.microbatches} microbatches: {found[0]}{more}. Such an op needs the "
            "whole batch at once, which a pipeline schedule sees one microbatch at a time (it runs microbatch 0 before "
            "the rest of the batch exists); train the batch over --dp instead (fxshard computes these ops on the "
            "gathered batch there), or at --microbatches 1")


class _Whole:
    """The rewrite: each value's whole-batch form (``forms``), made once, and the nodes computed on the whole batch."""

    def __init__(self, gm: fx.GraphModule, rows: BatchRows, dp: int):
        self.gm, self.rows, self.dp = gm, rows, dp
        self.whole: list[fx.Node] = []  # computed on the whole batch, in order (with what this pass inserts)
        self.computed: set[fx.Node] = set()  # the model's nodes among them
        self.forms: dict[fx.Node, fx.Node] = {}

    def carries(self, node: fx.Node) -> bool:
        """Whether ``node`` reads the whole batch's values only (each value of the batch it reads is computed
        whole): computed whole too, rather than each of its inputs taken back to its rows."""
        args = [a for a in tensor_args(node)]
        if node.target is operator.getitem:
            return node.args[0] in self.computed
        return any(a in self.computed for a in args) and all(
            a in self.computed or self.rows.of(a) == Replicate() for a in args)

    def compute(self, node: fx.Node) -> None:
        """``node`` on the whole batch: its operands' whole forms, its sizes the whole batch's."""
        node.args = fx.node.map_arg(node.args, lambda a: self.form(a, node))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda a: self.form(a, node))
        self._grow(node)
        self.whole.append(node)
        self.computed.add(node)
        self.forms[node] = node

    def form(self, a: fx.Node, user: fx.Node) -> fx.Node:
        """``a``'s whole-batch value, for ``user``."""
        if a in self.forms:
            return self.forms[a]
        p = self.rows.of(a)
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or p == Replicate():
            return a
        if isinstance(p, Ids):  # row numbers: the whole batch's own, made again at its size
            with self.gm.graph.inserting_before(user):
                made = self.gm.graph.node_copy(a, lambda b: self.form(b, user))
            self._grow(made, a.name)
            self.whole.append(made)
        elif isinstance(p, Shard) and not isinstance(val.shape[p.dim], int):
            why = self.rows.mixing.get(user.name) or f"{node_fqn(user) or 'model'}: {user.name} ({user.target})"
            raise LayoutError(f"--dp {self.dp}: {why}; computed on the whole batch, it reads {a.name}, a selection of "
                              "each rank's rows (a size the data decides: a boolean index, torch.where), which no "
                              "gather over the ranks takes at unequal sizes. Compute it on each row alone, or train "
                              "at --dp 1")
        elif isinstance(p, Shard) and not p.general:
            made = self._insert(rtc.gather_to, (a, Group(DP)), {"dim": p.dim} | (
                {"blocks": p.blocks} if p.blocks > 1 else {}), after=a, like=a, collective="gather_to")
        elif isinstance(p, Partial):  # each rank's part of a sum (mean) over the batch: summed over the ranks
            one = self._insert(aten.unsqueeze.default, (a, 0), {}, after=a, like=a)
            gathered = self._insert(rtc.gather_to, (one, Group(DP)), {"dim": 0}, after=one, like=a,
                                    collective="gather_to")
            made = self._insert(aten.sum.dim_IntList, (gathered, [0]), {}, after=gathered, like=a)
            if p.reduce == "avg":
                made = self._insert(aten.div.Tensor, (made, float(self.dp)), {}, after=made, like=a)
        elif isinstance(p, Picked):
            why = self.rows.mixing.get(user.name) or f"{node_fqn(user) or 'model'}: {user.name} ({user.target})"
            raise LayoutError(f"--dp {self.dp}: {why}; computed on the whole batch, it would need the whole batch's "
                              f"numbers, which fxshard cannot make of each rank's ({a.name}). Use the numbers only "
                              "to index the rows they number and write results back to them, or train at --dp 1")
        else:
            raise LayoutError(f"{node_fqn(user) or 'model'}: {user.name} ({user.target}) is computed on the whole "
                              f"batch under --dp {self.dp} and reads {a.name}, whose whole value fxshard cannot make "
                              f"({p}); train at --dp 1")
        self.forms[a] = made
        return made

    def _grow(self, node: fx.Node, name: str | None = None) -> None:
        """The numbers among its arguments that follow the batch, at the whole batch (:func:`whole_size`)."""
        pairs = self.rows.sizes.get(name or node.name)
        if not pairs:
            return
        leaves, spec_ = pytree.tree_flatten((node.args, node.kwargs))
        ints = [i for i, x in enumerate(leaves) if type(x) in (int, float)]
        if len(ints) != len(pairs):
            raise LayoutError(f"{node_fqn(node) or 'model'}: {node.name} ({node.target}) is computed on the whole "
                              "batch and its sizes changed since capture; train at --dp 1")
        for i, (one, two) in zip(ints, pairs, strict=True):
            if one != two:
                if leaves[i] != one:
                    raise LayoutError(
                        f"{node_fqn(node) or 'model'}: {node.name} ({node.target}) is computed on the whole batch, and "
                        f"its size {one} (the batch's) is also split over tp ({leaves[i]}); train at --dp 1")
                leaves[i] = whole_size(one, two, self.dp)
        node.args, node.kwargs = pytree.tree_unflatten(leaves, spec_)

    def take_back(self) -> None:
        """Each whole value's readers outside the whole computation read this rank's part of it: its rows, or its
        share of a sum over the batch (the whole sum over dp: the ranks' shares add up to it)."""
        computed = set(self.whole)
        for node in [n for n in self.whole if n in self.computed]:
            p = self.rows.of(node)
            readers = [u for u in node.users if u not in computed]
            if not readers or p in (Replicate(), Partial("avg")) or node.name in self.rows.ratios \
                    or isinstance(node.meta.get("val"), (tuple, list)):
                continue  # the same on every rank: read as it is
            if p == Partial("sum"):
                own = self._insert(aten.div.Tensor, (node, float(self.dp)), {}, after=node, like=node)
                computed.add(own)
            elif isinstance(p, Shard):
                own = self._insert(rtc.own_rows, (node, Group(DP)), {"dim": p.dim} | (
                    {"blocks": p.blocks} if p.blocks > 1 else {}) | ({"sizes": p.sizes} if p.sizes else {}),
                    after=node, like=node)
            else:
                raise LayoutError(f"{node_fqn(node) or 'model'}: {node.name} ({node.target}) is computed on the "
                                  "whole batch under --dp and has no rows of its own to give back "
                                  f"({', '.join(u.name for u in readers)} read it); train at --dp 1")
            for u in readers:
                u.replace_input_with(node, own)

    def _insert(self, target, args, kwargs, *, after: fx.Node, like: fx.Node, collective: str = "") -> fx.Node:
        if after.op == "placeholder":
            after = next(n for n in self.gm.graph.nodes if n.op != "placeholder").prev
        with self.gm.graph.inserting_after(after):
            node = self.gm.graph.call_function(target, args, kwargs)
        inputs = None if collective else tuple(spec(a).placement for a in tensor_args(node))
        node.meta = {"val": like.meta.get("val"), "nn_module_stack": like.meta.get("nn_module_stack", {}),
                     "stack_trace": like.meta.get("stack_trace", ""),
                     "fxshard": dataclasses.replace(spec(like), collective=collective, inputs=inputs,
                                                    role="the whole batch's rows")}
        if target is not rtc.gather_to and target is not rtc.own_rows:
            self.whole.append(node)
        return node

    def revalue(self) -> None:
        """The values of the nodes made whole (and what reads them back), at their new shapes, on fake tensors."""
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        changed = set(self.whole) | {n for n in self.gm.graph.nodes
                                     if n.target in (rtc.gather_to, rtc.own_rows) and spec(n).role
                                     == "the whole batch's rows"}

        def fake(a):
            v = a.meta.get("val") if isinstance(a, fx.Node) else a
            return torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v

        with mode:
            for node in [n for n in self.gm.graph.nodes if n in changed]:
                args, kwargs = pytree.tree_map(fake, fx.node.map_arg((node.args, node.kwargs), fake))
                if node.target is rtc.gather_to:
                    value = _gathered(args[0], kwargs.get("dim", 0), self.dp)
                elif node.target is rtc.own_rows:
                    value = _taken(args[0], kwargs["dim"], self.dp)
                elif spec(node).collective:  # a tp collective keeps its input's global shape
                    value = args[0]
                else:
                    try:
                        value = node.target(*args, **kwargs)
                    except Exception as e:
                        line = f", {model_line(node)}" if model_line(node) else ""
                        raise LayoutError(f"{node_fqn(node) or 'the model'}: {node.name} ({node.target}{line}) is "
                                          f"computed on the whole batch under --dp {self.dp} and fails at its size: "
                                          f"{type(e).__name__}: {str(e).splitlines()[0]}; train at --dp 1") from e
                node.meta["val"] = value


def whole_size(one, two, parts: int):
    """A number of the program at ``parts`` times the rows, from its values at the rows (``one``) and at twice as
    many (``two``): a size or count (twice as large: ``parts`` times), a reciprocal of one (half: ``1 / parts``),
    else the line through the two (a size plus a constant)."""
    if two == 2 * one:
        return one * parts
    if 2 * two == one and isinstance(one, float):
        return one / parts
    return one + (two - one) * (parts - 1)


def _gathered(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= parts
    return x.new_empty(shape)


def _taken(x: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] //= parts
    return x.new_empty(shape)
