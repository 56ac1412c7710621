"""Split the parameters that split computation asks for: those no plan style names.

A plan names the Linear, Conv1D and Embedding modules.  A mixer also has bare parameters and other ops' weights:
Mamba's ``A_log``, ``D``, ``dt_bias``, its depthwise ``conv1d``, a gated norm's weight, Mamba-1's ``dt_proj``
read through a matrix product.  Left whole, each is sliced on every rank where it meets the split heads or
channels (a ``scatter``, whose backward gathers its gradient): correct, but every rank keeps all of it.

:func:`demanded_placements` finds, for each such parameter, the split that its own ops carry to that meeting
point unchanged: it runs the rules (:mod:`fxshard.ir.sharding`) over the values computed from the parameter alone
(a cast, an exponential, a view, a product with whole values) with the parameter split, and accepts the split
when each such value reaches the split computation in the placement it needs there, with no gather on the way.
The tensor-parallel pass then propagates again with those parameters split, until no parameter is asked for.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from fxshard.ir.placement import Placement, Replicate, Shard
from fxshard.ir.sharding import Decision, Propagation, _rule, shape, tensor_args

R = Replicate()
_CONE = 24  # nodes whose requests of a parameter's values name the splits to try
_WALK = 4096  # ops a split is carried through before giving up on it (a scan unrolled over the sequence: many)


def demanded_placements(gm: fx.GraphModule, prop: Propagation, weights: dict[fx.Node, Placement],
                        params: set[fx.Node], tp: int) -> dict[fx.Node, Placement]:
    """``{parameter: split}`` for whole parameters (no plan style, not yet split) whose split the rules carry to
    where split computation reads them (module docstring)."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node not in params or node in weights or not node.users:
            continue
        for candidate in _candidates(node, prop):
            if candidate.divides(shape(node)[candidate.dim], tp) and _carried(node, candidate, prop):
                found[node] = candidate
                break
    return found


def _candidates(param: fx.Node, prop: Propagation) -> list[Shard]:
    """The splits to try: what the first split consumer of the parameter's values asks of them, moved to each of
    the parameter's dimensions of that size, then each dimension split plainly."""
    asked, cone = [], _cone(param)
    for node in cone:
        for a, p in zip(tensor_args(node), prop.decisions[node].inputs, strict=False):
            if isinstance(p, Shard) and prop.decisions[a].out == R and (a in cone or a is param):
                asked.append((p, shape(a)[p.dim]))
    out = []
    for p, size in asked:
        out += [p.moved(d) for d, s in enumerate(shape(param)) if s == size and p.general]
    return out + [Shard(d) for d in range(len(shape(param)))]


def _cone(param: fx.Node) -> set[fx.Node]:
    """The values computed from ``param`` within a few ops (whatever else they read): a walk cut at ``_CONE`` nodes
    found, so not :func:`fxshard.graph.walk`, which goes to the end."""
    seen, stack = set(), [param]
    while stack and len(seen) < _CONE:
        for user in stack.pop().users:
            if user not in seen and user.op == "call_function":
                seen.add(user)
                stack.append(user)
    return seen


def _carried(param: fx.Node, split: Shard, prop: Propagation) -> bool:
    """Whether, with ``param`` split as ``split`` and every other value as ``prop`` has it, the rules carry the split
    through the parameter's own values to consumers that take them as they come, each such consumer's output
    placed as it already is (so nothing past it changes), at least one of which now reads the parameter's split
    where it sliced a whole copy before."""
    placed: dict[fx.Node, Placement] = {param: split}
    asked, steps = False, 0
    order = {n: i for i, n in enumerate(param.graph.nodes)}
    pending = sorted({u for u in param.users}, key=order.__getitem__)
    while pending:
        node = pending.pop(0)
        steps += 1
        if steps > _WALK or node.op != "call_function":
            return False
        args = tensor_args(node)
        ins = [placed.get(a, prop.decisions[a].out) for a in args]
        if isinstance(node.meta.get("val"), (tuple, list)) or node.target is operator.getitem:
            return False
        now = prop.decisions[node]
        decision = _rule(node, args, ins) if any(p != R for p in ins) else Decision(R, tuple(R for _ in args))
        if decision is None:
            return False
        if any(a in placed and need != placed[a] for a, need in zip(args, decision.inputs, strict=True)):
            return False  # the split would be moved (gathered, sliced) on the way
        asked |= any(a in placed and placed[a] == need and prop.decisions[a].out == R and now.inputs[i] == need
                     for i, (a, need) in enumerate(zip(args, decision.inputs, strict=True)))
        if decision.out == now.out:
            continue  # absorbed: the consumer computes as before
        if not isinstance(decision.out, Shard) or decision.rewrite:
            return False
        placed[node] = decision.out
        pending = sorted(set(pending) | set(node.users), key=order.__getitem__)
    return asked
