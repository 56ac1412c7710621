"""Sharding rules for the ops state-space and linear-attention mixers are made of.

Mamba-2's chunked scan, Mamba-1's selective scan, Gated DeltaNet, LFM2's short convolutions and RG-LRU lower (under
``torch.export``, non-strict, on their torch paths) to the ops below besides matrix products and elementwise math:
depthwise convolutions over channels, cumulative sums over the sequence, einsums over heads, paddings of the
sequence, groups repeated to heads, triangular masks, and batched products over heads.  Each rule keeps a split of
the heads or channels through the op where the op computes each head or channel on its own; none is keyed on a
model class.  They register into the one table of :mod:`fxshard.ir.sharding` and are tested like every rule, by
``tests/ir/test_sharding_rules.py`` (forward and backward, tp=2 and 4).
"""

from __future__ import annotations

import torch

from fxshard.ir.placement import Partial, Replicate, Shard
from fxshard.ir.sharding import Decision, _aligned, _norm, argument, common_split, rule, shape

aten = torch.ops.aten
R = Replicate()


@rule(aten.conv1d, aten.conv2d, general=True)
def _convolution(node, args, placements):
    """A grouped convolution split by its groups: input channels ``S(1)``, weight and bias rows split alike
    (``S(0)``); each rank convolves its groups (the pass gives the op its local ``groups``).  A depthwise one
    (a group per channel: Mamba's, LFM2's, Gated DeltaNet's causal conv) takes any split of its channels,
    unequal packed blocks (Mamba-2's x, B, C) and parts several ranks hold alike included."""
    x, w = placements[0], placements[1]
    b = placements[2] if len(args) > 2 else None
    groups = argument(node, "groups", 1)
    channels = shape(args[0])[1]
    if not isinstance(x, Shard) or x.dim != 1 or groups == 1 or shape(args[1])[0] % groups:
        return None
    depthwise = groups == channels == shape(args[1])[0]
    if x.general and not depthwise or x.blocks > 1 and not depthwise:
        return None
    need_w = x.moved(0)
    if w not in (R, need_w) or b not in (None, R, need_w):
        return None
    return Decision(x, (x, need_w) + ((need_w,) if b is not None else ()) + tuple(placements[3:]))


@rule(aten.cumsum, aten.cumprod, general=True)
def _scan(node, args, placements):
    """A running sum or product along another dimension than the split one runs on each part as it is."""
    p = placements[0]
    if not isinstance(p, Shard) or p.dim == _norm(argument(node, "dim"), len(shape(node))):
        return None
    return Decision(p, (p,))


@rule(aten.pad, aten.constant_pad_nd, general=True)
def _pad(node, args, placements):
    """Padding of other dimensions (a sequence padded to whole chunks) keeps the split."""
    p = placements[0]
    pad = argument(node, "pad")
    n = len(shape(node))
    if not isinstance(p, Shard) or (argument(node, "mode", "constant") or "constant") != "constant":
        return None
    padded = {n - 1 - i // 2 for i, amount in enumerate(pad) if amount}
    return Decision(p, (p,)) if p.dim not in padded else None


@rule(aten.tril, aten.triu, general=True)
def _triangle(node, args, placements):
    """A triangular mask of the last two dimensions keeps a split of the others."""
    p = placements[0]
    if not isinstance(p, Shard) or p.dim >= len(shape(node)) - 2:
        return None
    return Decision(p, (p,))


@rule(aten.repeat_interleave, general=True)
def _repeat_interleave(node, args, placements):
    """``x.repeat_interleave(n, dim)``: groups repeated to heads (Mamba-2's B and C, Gated DeltaNet's q and k).
    A split of the groups is a split of their heads, each rank repeating its own groups (the pass gives the op
    its local ``repeats`` and ``output_size``); a group held whole by several ranks (``S(d)/G``, G groups fewer than
    tp) is repeated by each of them to its own heads only.  Along another dimension the split stays."""
    p = placements[0]
    repeats, dim = argument(node, "repeats"), argument(node, "dim")
    if not isinstance(p, Shard) or not isinstance(repeats, int) or dim is None or len(args) != 1:
        return None
    if _norm(dim, len(shape(node))) != p.dim:
        return Decision(p, (p,))
    if p.blocks > 1 or p.sizes:
        return None
    if p.parts and p.parts[0] == shape(args[0])[p.dim]:  # one group per part: each rank repeats it to its heads
        return Decision(Shard(p.dim), (p,))
    return Decision(p, (p,))


@rule(aten.stack, general=True)
def _stack(node, args, placements):
    """Values split alike stacked along a new dimension (Mamba-1's scan outputs, one per position): the split
    stays, shifted past the new dimension."""
    if len(set(placements)) != 1 or not isinstance(placements[0], Shard):
        return None
    p = placements[0]
    dim = _norm(argument(node, "dim", 0), len(shape(node)))
    return Decision(p.moved(p.dim + (dim <= p.dim)), tuple(placements))


@rule(aten.einsum, general=True)
def _einsum(node, args, placements):
    """An einsum whose operands are split along one shared letter (the heads ``h`` of Mamba-2's chunked scan,
    ``bclhn,bcshn->bclsh``): kept, the result is split along it; summed over, the result is a partial sum.
    Operands without the letter stay whole; operands with it and whole are split alike (a scatter)."""
    equation = argument(node, "equation")
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != len(args) or any(len(t) != len(set(t)) or len(t) != len(shape(a)) for t, a in zip(terms, args,
                                                                                                     strict=True)):
        return None
    splits, letters = [], set()
    for term, p in zip(terms, placements, strict=True):
        if isinstance(p, Partial):
            return None
        if isinstance(p, Shard):
            letters.add(term[p.dim])
            splits.append(p.moved(0))
    split = common_split(splits)
    if len(letters) != 1 or split is None:
        return None
    letter = letters.pop()
    if letter not in output and (split.general or split.blocks > 1):
        return None  # a part several ranks hold alike must not be summed over them
    need = tuple(split.moved(t.index(letter)) if letter in t else R for t in terms)
    for a, p in zip(args, need, strict=True):
        if isinstance(p, Shard) and shape(a)[p.dim] != _letter_size(letter, terms, args):
            return None  # broadcast along the letter
    out = split.moved(output.index(letter)) if letter in output else Partial()
    return Decision(out, need)


def _letter_size(letter: str, terms: list[str], args) -> int:
    return max(shape(a)[t.index(letter)] for t, a in zip(terms, args, strict=True) if letter in t)


@rule(aten.baddbmm, general=True)
def _baddbmm(node, args, placements):
    """``bias + x @ w`` batched over heads (RecurrentGemma's block-diagonal gates, a weight per head): split by
    heads, every operand split alike, the bias aligned as it broadcasts."""
    bias, x, w = placements
    if not isinstance(x, Shard) or x.dim != 0 or w != x or x.general or x.blocks > 1:
        return None
    if isinstance(bias, Partial):
        return None
    need_bias = _aligned(shape(args[0]), bias, x, len(shape(node)))
    return Decision(x, (need_bias, x, w))


def local_repeats(node, inp: Shard, out: Shard, tp: int) -> tuple[int, int | None]:
    """``(repeats, output_size)`` of a rank's ``repeat_interleave`` along its split dimension."""
    dim = _norm(argument(node, "dim"), len(shape(node)))
    local_out = out.local_size(shape(node)[dim], tp)
    local_in = inp.local_size(shape(node.args[0])[dim], tp)
    return local_out // local_in, local_out if argument(node, "output_size") is not None else None


def local_groups(node, x: Shard, tp: int) -> int:
    """The ``groups`` of a rank's convolution: its own groups."""
    groups = argument(node, "groups", 1)
    channels = shape(node.args[0])[1]
    return groups * x.local_size(channels, tp) // channels
