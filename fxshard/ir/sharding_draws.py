"""Sharding rules for random draws: each element is drawn by its place in the whole tensor, so a draw splits as the
value it is drawn for (:mod:`fxshard.runtime.draws` draws a rank's slice of one device's values).

``rand_like(h)`` of a split ``h`` draws a split result; ``x.exponential_()``, ``x.bernoulli_(p)``, ``bernoulli(p)``
and ``normal(mean, std)`` are elementwise in their tensors, aligned as they broadcast.  Only ordinary splits: a split
of unequal or replicated blocks is gathered first (as for dropout).  They register into the one table of
:mod:`fxshard.ir.sharding`, which the batch's rows (:mod:`fxshard.ir.rows`) and context parallelism ask too::

    rule_decision(rand_like_node, [h], [Shard(2)])   # Decision(out=Shard(2), inputs=(Shard(2),))
"""

from __future__ import annotations

import torch

from fxshard.ir.placement import Partial, Shard
from fxshard.ir.sharding import Decision, _pointwise, rule

aten = torch.ops.aten


@rule(aten.rand_like, aten.randn_like, aten.randint_like)
def _drawn_like(node, args, placements):
    """Only the input's shape is read: a split input makes a split draw."""
    p = placements[0]
    if not isinstance(p, Shard) or p.general:
        return None
    return Decision(p, tuple(placements))


@rule(aten.bernoulli_, aten.exponential_, aten.normal_, aten.uniform_, aten.random_, aten.cauchy_, aten.log_normal_,
      aten.geometric_, aten.bernoulli, aten.normal)
def _drawn_elementwise(node, args, placements):
    """A draw per element of its tensors (the value drawn into, a Bernoulli's probabilities, a normal's means)."""
    if any(isinstance(p, Partial) or isinstance(p, Shard) and p.general for p in placements):
        return None
    return _pointwise(node, args, placements)
