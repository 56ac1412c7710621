"""Placement rules over the ``cp`` axis (context parallelism) that the tensor-parallel table does not hold.

Over cp, a value is split along its sequence (``Shard(d)``: this rank's tokens, in the cp order), whole
(``Replicate``: every token, in the cp order) or a per-rank part of a loss: ``Partial("sum")`` (a sum over this
rank's tokens: the ranks' values add up to the whole) or ``Partial("avg")`` (a mean over this rank's tokens, or a
token-mean share: the ranks' values average to the whole, as dp ranks' losses do).  Every other op takes the
tensor-parallel rule of :mod:`fxshard.ir.sharding` (they are axis-free: a split is a split); these add what only a
sequence split meets: a loss over split tokens, GPT-2's ``addmm`` over flattened tokens, a slice that keeps every
token, and the query-rows rules of attention (keys and values whole)::

    decision = cp_rule(node, args, placements, parts=2)   # None: no cp rule (ask the tp table)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxshard.ir.placement import Partial, Placement, Replicate, Shard
from fxshard.ir.sharding import Decision, argument, rule, shape
from fxshard.runtime import collectives as rtc
from fxshard.runtime import context_parallel as rcp
from fxshard.runtime import loss as rt_loss

aten = torch.ops.aten
R = Replicate()
SUM, AVG = Partial("sum"), Partial("avg")
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}
_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
# the ops through which a loss's per-rank part stays a part: value -> (op(value, whole) part of op(whole))
_LINEAR = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar,
           aten.neg.default, aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.detach.default,
           operator.add, operator.mul, operator.truediv}
MATMULS = {aten.mm.default: 1, aten.bmm.default: 1, aten.matmul.default: 1, aten.baddbmm.default: 2}  # -> rhs index


def cp_rule(node: fx.Node, args: list[fx.Node], placements: list[Placement]) -> Decision | None:
    """The cp decision for ``node`` when one of its inputs is split or partial, or None (use the tp table)."""
    if node.target in _LOSSES:
        return _loss(node, args, placements)
    if node.target is rt_loss.token_mean:
        return _token_mean(placements)
    if any(isinstance(p, Partial) for p in placements):
        return _partial(node, args, placements)
    if node.target is aten.addmm.default:
        return _addmm_rows(placements)
    if node.target is aten.baddbmm.default:
        return _baddbmm_rows(node, args, placements)
    if getattr(node.target, "overloadpacket", None) is aten.slice:
        return _whole_slice(node, args, placements)
    if node.target in (aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim):
        return _reduce_tokens(node, args, placements)
    if node.target is aten.scaled_dot_product_attention.default:
        return _sdpa_rows(node, args, placements)
    if node.target in _ALONG:
        return _along_other(node, args, placements)
    return None


# ops that select, order or scan along one dimension, each slice along it on its own: the name of that argument
_ALONG = {aten.topk.default: "dim", aten.sort.default: "dim", aten.sort.stable: "dim", aten.argsort.default: "dim",
          aten.argsort.stable: "dim", aten.cumsum.default: "dim", aten.cumprod.default: "dim"}


def _along_other(node, args, placements) -> Decision | None:
    """A top-k, sort or cumulative scan along another dimension than the split one keeps the split: each token's
    result is computed from that token alone (a router's top-k over the experts).  Along the split dimension it
    mixes the tokens: no rule (the pass refuses it, naming the module)."""
    p = placements[0]
    n = len(shape(args[0]))
    if not isinstance(p, Shard) or any(x != R for x in placements[1:]) or n == 0:
        return None
    dim = argument(node, _ALONG[node.target])
    dim = -1 if dim is None else dim
    if dim % n == p.dim % n:
        return None
    val = node.meta.get("val")
    return Decision(tuple(p for _ in val) if isinstance(val, (tuple, list)) else p, tuple(placements))


def _loss(node, args, placements) -> Decision | None:
    """A loss per token over split tokens: ``none`` keeps the split, ``sum`` is this rank's part of the sum, ``mean``
    a mean over this rank's tokens (whose average over the ranks is the mean only when they count alike: the
    token-mean pass makes recognized token means sums)."""
    logits = placements[0]
    if not isinstance(logits, Shard) or logits.dim != 0 or len(shape(args[0])) != 2:
        return None
    reduction = _REDUCTION[argument(node, "reduction", 1)]
    need = (logits, logits) + tuple(R for _ in args[2:])
    out = {"none": logits, "sum": SUM, "mean": AVG}[reduction]
    return Decision(out, need)


def _token_mean(placements) -> Decision | None:
    """``rt.token_mean(sum over this rank's tokens, targets)``: the step's count divides it, and training averages the
    ranks' losses (the divisor counts the cp ranks among the parts): an average-part.  The targets stay whole."""
    loss = placements[0]
    if loss not in (SUM, R):
        return None
    return Decision(AVG if loss == SUM else R, (loss, *(R for _ in placements[1:])))


def _partial(node, args, placements) -> Decision | None:
    """Sums and averages of parts: ``part + part`` (same kind), ``part * whole`` and ``part / whole`` (the same
    factor on every rank), ``avg-part + whole`` (the average of ``p_r + c`` is ``mean(p) + c``), casts, negation."""
    if node.target not in _LINEAR:
        return None
    kinds = {p for p in placements if isinstance(p, Partial)}
    if len(kinds) != 1 or any(isinstance(p, Shard) for p in placements):
        return None
    kind = kinds.pop()
    parts = sum(isinstance(p, Partial) for p in placements)
    if node.target in (aten.add.Tensor, aten.sub.Tensor, operator.add):
        if parts < len(placements) and kind != AVG:
            return None
    elif node.target in (aten.mul.Tensor, aten.div.Tensor, operator.mul, operator.truediv):
        if parts != 1 or (node.target in (aten.div.Tensor, operator.truediv)
                          and not isinstance(placements[0], Partial)):
            return None
    return Decision(kind, tuple(placements))


def _addmm_rows(placements) -> Decision | None:
    """``addmm(bias, x, w)`` over flattened tokens (GPT-2's ``Conv1D``): rows split in blocks, weight whole."""
    b, x, w = placements
    if w == R and isinstance(x, Shard) and x.dim == 0 and b == R:
        return Decision(x, (R, x, w))
    return None


def _baddbmm_rows(node, args, placements) -> Decision | None:
    """``baddbmm(bias, q, k^T)`` (Bloom's ALiBi scores) with q's rows split and k^T whole: the rows split, the bias
    along them where it has them (ALiBi's ``[B*H, 1, S]`` broadcasts over rows: whole, in the cp order)."""
    bias, b1, b2 = placements[:3]
    if not (isinstance(b1, Shard) and b1.dim == 1 and b2 == R):
        return None
    s = shape(args[0])
    need_bias = R if len(s) < 2 or s[-2] == 1 else Shard(len(s) - 2)
    if isinstance(bias, Shard) and bias != need_bias:
        return None
    return Decision(b1, (need_bias, b1, b2))


def _whole_slice(node, args, placements) -> Decision | None:
    """``x[:, 0:]`` along the split dimension keeps every token: the split as it is."""
    p = placements[0]
    if not isinstance(p, Shard):
        return None
    n = len(shape(args[0]))
    dim = argument(node, "dim") % n
    start, end, step = argument(node, "start") or 0, argument(node, "end"), argument(node, "step") or 1
    size = shape(args[0])[dim]
    if not isinstance(end, (int, type(None))):  # an end the data decides (half a selection's count): no rule here
        return None
    if dim != p.dim or start not in (0, None) or step != 1 or (end is not None and end < size):
        return None
    return Decision(p, (p,))


def _reduce_tokens(node, args, placements) -> Decision | None:
    """A sum (mean) of every element, tokens included: this rank's part of the sum (of the mean: every rank holds as
    many tokens).  A reduction over the tokens that keeps other dimensions (a sum per sample) has no rule."""
    p = placements[0]
    n = len(shape(args[0]))
    dims = argument(node, "dim")
    if not isinstance(p, Shard) or (dims and {d % n for d in dims} != set(range(n))):
        return None
    mean = node.target in (aten.mean.default, aten.mean.dim)
    return Decision(AVG if mean else SUM, (p,))


def _sdpa_rows(node, args, placements) -> Decision | None:
    """Attention of split query rows over whole keys and values (all-gathered): rows split, the mask split along
    its rows where it has them.  ``is_causal`` (which assumes the top-left triangle) must have been made a mask."""
    q, k, v = placements[:3]
    n = len(shape(node))
    if not (isinstance(q, Shard) and q.dim == n - 2 and k == v == R) or argument(node, "is_causal"):
        return None
    need = [q, R, R]
    for a, p in zip(args[3:], placements[3:], strict=True):
        s = shape(a)
        want = R if len(s) < 2 or s[-2] == 1 else Shard(len(s) - 2)
        if isinstance(p, Shard) and p != want:
            return None
        need.append(want)
    return Decision(q, tuple(need))


# ---------------------------------------------------------------- the cp attention calls under tensor parallelism
# The tensor-parallel pass runs after passes/context_parallel.py and meets its attention calls: split over tp by
# heads like the attention they replace (every head attends on its own), so tp ranks do not each run every head.


@rule(rcp.ring_attention_step, rcp.ring_attention_last, rcp.seq_to_heads, rcp.heads_to_seq, rcp.cp_causal_attention)
def _cp_attention_heads(node: fx.Node, args: list[fx.Node], placements: list[Placement]) -> Decision | None:
    """Key, value and query (and a ring step's outputs) split alike along the heads (dimension 1 of
    ``[B, H, S, D]``); a mask split alike where it has heads, whole where it broadcasts over them (size 1)."""
    head = placements[0]
    n = len(shape(args[0]))
    if not (isinstance(head, Shard) and head.dim == 1 and head.blocks == 1 and n == 4):
        return None
    if node.target in (rcp.seq_to_heads, rcp.heads_to_seq):  # they move heads within each tp rank's own, so a tp
        if node.kwargs.get("head_dim", 1) != 1:                # split of the heads stays one
            return None
        return Decision(head, (head,))
    mask = node.kwargs.get("mask")
    need = tuple(R if a is mask and shape(a)[1] == 1 else head for a in args)
    if node.target is rcp.cp_causal_attention:
        return Decision(head, need)
    outs = 4 if node.target is rcp.ring_attention_step else 2
    return Decision(tuple(head for _ in range(outs)), need)


@rule(rtc.gather_to)
def _cp_gather_keeps_heads(node: fx.Node, args: list[fx.Node], placements: list[Placement]) -> Decision | None:
    """The cp all-gather of K or V along the sequence, under tp: this tp rank's heads (a split of another dimension)
    are gathered alone, so the exchange moves 1/tp of the key/value width, not every head."""
    p = placements[0]
    group = node.args[1] if len(node.args) > 1 else None
    if getattr(group, "axis", None) != "cp" or not isinstance(p, Shard) or p.blocks != 1:
        return None
    if p.dim % len(shape(args[0])) == node.kwargs.get("dim", 0) % len(shape(args[0])):
        return None
    return Decision(p, (p,))


@rule(rcp.merge_attention)
def _merge_heads(node: fx.Node, args: list[fx.Node], placements: list[Placement]) -> Decision | None:
    """The blocks' outputs and log-sum-exps merged head by head: split alike along the heads, the result too."""
    head = placements[0]
    if not (isinstance(head, Shard) and head.dim == 1) or any(p != head for p in placements):
        return None
    return Decision(head, tuple(placements))
