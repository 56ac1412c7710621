"""The cases of ``test_sharding_rules.py``: each rule's op over its argument variants and input placements.

``S(d)`` / ``S(d, k)``: split along ``d`` (``k`` packed blocks); a partial sum is made by a row-split matmul
(``_psum``: ``[4, 8] S(1) @ [8, n] S(0)``) in front of the op.  Sizes divide by 4 (the tp=4 cases).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fxshard.ir.placement import Replicate, Shard

aten = torch.ops.aten
R = Replicate()
S = Shard
_g = torch.Generator().manual_seed(0)


def x(*shape):
    return torch.randn(*shape, generator=_g)


def ids(high, *shape):
    return torch.randint(0, high, shape, generator=_g)


def mask(*shape):
    return torch.rand(*shape, generator=_g) > 0.3


@dataclasses.dataclass(frozen=True)
class Case:
    """``fn(*inputs)`` with ``inputs[i]`` placed ``placements[i]``; the decision for the nodes of ``op``.

    Floating inputs are parameters (they get gradients) unless listed in ``frozen``; the others are buffers,
    except those in ``batch``, which the forward takes as inputs (a loss's targets: the token-mean path)."""

    key: str
    fn: Callable
    inputs: tuple
    placements: tuple
    op: object
    expect: str = "split"  # "split" | "declined" | "whole" | "refused"
    frozen: frozenset = frozenset()
    batch: frozenset = frozenset()
    keywords: bool = False  # pass every argument after the leading tensors by name


CASES: list[Case] = []


def case(key, fn, inputs, placements, op, expect="split", **kw):
    c = Case(key, fn, tuple(inputs), tuple(placements), op, expect, **kw)
    CASES.append(c)
    return c


def _psum(a, w):
    return a @ w  # a S(1), w S(0): a partial sum over the ranks


# ---------------------------------------------------------------- pointwise (registered and tagged)

for name, f, op in [("gelu", F.gelu, aten.gelu), ("gelu-tanh", lambda a: F.gelu(a, approximate="tanh"), aten.gelu),
                    ("silu", F.silu, aten.silu), ("relu", F.relu, aten.relu), ("tanh", torch.tanh, aten.tanh),
                    ("sigmoid", torch.sigmoid, aten.sigmoid), ("exp", torch.exp, aten.exp),
                    ("clamp", lambda a: a.clamp(-0.5, 0.5), aten.clamp),
                    ("pow", lambda a: a.pow(3), aten.pow), ("clone", lambda a: a.clone() * 1, aten.clone),
                    ("contiguous", lambda a: a.t().contiguous(), aten.contiguous),
                    ("to-double", lambda a: a.to(torch.float64), aten.to)]:
    case(f"{name}-S0", f, [x(4, 8)], [S(0)], op)
    case(f"{name}-S1", f, [x(4, 8)], [S(1)], op)
case("gelu-packed", F.gelu, [x(4, 12)], [S(1, 3)], aten.gelu)
case("detach", lambda a: a.detach() + 0, [x(4, 8)], [S(1)], aten.detach)
case("dropout-p0", lambda a: F.dropout(a, 0.0) * 2, [x(4, 8)], [S(1)], aten.dropout)
case("dropout-p0-keyword", lambda a: F.dropout(a, 0.0) * 2, [x(4, 8)], [S(1)], aten.dropout, keywords=True)
case("dropout-eval", lambda a: F.dropout(a, 0.5, training=False) * 2, [x(4, 8)], [S(1)], aten.dropout)

case("add-alpha", lambda a, b: torch.add(a, b, alpha=2.0), [x(4, 8), x(4, 8)], [S(1), R], aten.add)
case("add-both-split", torch.add, [x(4, 8), x(4, 8)], [S(0), S(0)], aten.add)
case("add-broadcast-row", torch.add, [x(4, 8), x(8)], [S(1), R], aten.add)
case("add-broadcast-unit", torch.add, [x(4, 8), x(1, 8)], [S(0), R], aten.add)
case("add-broadcast-column", torch.add, [x(4, 8), x(4, 1)], [S(1), R], aten.add)
case("add-split-broadcast-operand", torch.add, [x(4, 8), x(8)], [R, S(0)], aten.add)
case("add-packed-operand", torch.add, [x(4, 12), x(12)], [S(1, 3), R], aten.add)
case("add-crossed-splits", torch.add, [x(4, 4), x(4)], [S(0), S(0)], aten.add, "declined")
case("add-mixed-blocks", torch.add, [x(4, 12), x(12)], [S(1, 3), S(0)], aten.add, "declined")
case("add-partial", lambda a, w, b: _psum(a, w) + b, [x(4, 8), x(8, 8), x(4, 8)], [S(1), S(0), R], aten.add, "whole")
case("add-partial-beside-split", lambda a, w, b: _psum(a, w) + b, [x(4, 8), x(8, 8), x(4, 8)], [S(1), S(0), S(1)],
     aten.add)
case("sub-keyword", lambda a, b: torch.sub(a, b, alpha=0.5), [x(4, 8), x(8)], [S(1), R], aten.sub, keywords=True)
case("mul-scalar", lambda a: a * 3.0, [x(4, 8)], [S(0)], aten.mul)
case("div-floor", lambda a, b: torch.div(a, b, rounding_mode="floor"), [x(4, 8), x(4, 8).abs() + 0.5], [S(1), S(1)],
     aten.div)
case("where", torch.where, [mask(4, 8), x(4, 8), x(8)], [S(0), R, R], aten.where)
case("where-split-value", torch.where, [mask(4, 8), x(4, 8), x(8)], [R, R, S(0)], aten.where)
case("masked-fill", lambda a, m: a.masked_fill(m, -1.0), [x(4, 8), mask(4, 8)], [S(1), R], aten.masked_fill)
case("masked-fill-broadcast-mask", lambda a, m: a.masked_fill(m, 0.0), [x(2, 4, 8), mask(1, 8)], [S(1), R],
     aten.masked_fill)
case("masked-fill-tensor-value", lambda a, m, v: a.masked_fill(m, v), [x(4, 8), mask(4, 8), torch.tensor(0.25)],
     [S(0), R, R], aten.masked_fill)
case("type-as", lambda a, b: a.type_as(b), [x(4, 8), x(4, 8).double()], [S(1), R], aten.type_as, frozen=frozenset({1}))
case("add-in-place-on-split", lambda a, b: (a * 1).add_(b), [x(4, 8), x(8)], [S(1), R], aten.add_)
case("add-in-place-buffer-split", lambda a, b: a.add_(b), [x(4, 8), x(8)], [S(1), R], aten.add_,
     frozen=frozenset({0}))
case("add-in-place-buffer-whole", lambda a, b: a.add_(b), [x(4, 8), x(4, 8)], [R, S(0)], aten.add_, "declined",
     frozen=frozenset({0}))
case("add-in-place-on-whole", lambda a, b: (a * 1).add_(b), [x(4, 8), x(4, 8)], [R, S(0)], aten.add_, "declined")
# an in-place add the rule would have to move its written value for: nothing reads that value after it, so it is
# computed out of place (aten.add), its partial sums reduced / its split gathered first
case("add-in-place-on-partial", lambda a, w, b: _psum(a, w).add_(b), [x(4, 8), x(8, 8), x(4, 8)], [S(1), S(0), R],
     aten.add, "whole")
case("add-in-place-crossed", lambda a, b: (a * 1).add_(b), [x(4, 8), x(4, 8)], [S(0), S(1)], aten.add, "declined")

# ---------------------------------------------------------------- reshapes

case("view-heads", lambda a: a.view(4, 4, 4), [x(4, 16)], [S(1)], aten.view)
case("view-minus-one", lambda a: a.view(4, -1, 4), [x(4, 16)], [S(1)], aten.view)
case("view-split-rows", lambda a: a.view(2, 2, 16), [x(4, 16)], [S(0)], aten.view)
case("view-packed", lambda a: a.view(2, 2, 12), [x(4, 12)], [S(1, 3)], aten.view)
case("view-flatten-all", lambda a: a.view(32), [x(4, 8)], [S(0)], aten.view)
# a split of the second of two merged dims: each block of the first's split (--sp's [B, S, H] -> [B*S, H])
case("view-flatten-all-blocked", lambda a: a.view(32), [x(4, 8)], [S(1)], aten.view)
case("view-unflatten-blocks", lambda a: a.view(4, 8), [x(32)], [S(0, 4)], aten.view)
case("view-flatten-three-declined", lambda a: a.view(64), [x(4, 4, 4)], [S(1)], aten.view, "declined")
case("view-regroup", lambda a: a.view(2, 2, 4), [x(2, 8)], [S(1)], aten.view)
case("view-merge-uneven", lambda a: a.view(8, 3), [x(4, 6)], [S(0)], aten.view)
case("view-packed-regrouped", lambda a: a.view(4, 3, 4), [x(4, 12)], [S(1, 3)], aten.view)  # blocks -> a dim
case("view-keyword", lambda a: a.view(4, 4, 4), [x(4, 16)], [S(1)], aten.view, keywords=True)
case("reshape-merge-first", lambda a: a.reshape(8, 8), [x(2, 4, 8)], [S(0)], aten.reshape)
case("reshape-merge-second", lambda a: a.reshape(8, 8), [x(2, 4, 8)], [S(1)], aten.reshape)
case("reshape-unit-dims", lambda a: a.reshape(4, 8), [x(4, 1, 8)], [S(2)], aten.reshape)
case("unsafe-view", lambda a: aten._unsafe_view(a * 1, [4, 4, 4]), [x(4, 16)], [S(1)], aten._unsafe_view)
case("flatten", lambda a: a.flatten(1, 2), [x(2, 4, 4)], [S(1)], aten.flatten)
case("flatten-second", lambda a: a.flatten(0, 1), [x(2, 4, 4)], [S(1)], aten.flatten)
case("unflatten", lambda a: a.unflatten(1, (4, 4)), [x(4, 16)], [S(1)], aten.unflatten)
case("unflatten-negative", lambda a: a.unflatten(-1, (4, -1)), [x(4, 16)], [S(1)], aten.unflatten)
case("unflatten-other-dim", lambda a: a.unflatten(1, (4, 4)), [x(8, 16)], [S(0)], aten.unflatten)
case("unflatten-split-dim", lambda a: a.unflatten(0, (4, 2)), [x(8, 4)], [S(0)], aten.unflatten)
case("unflatten-keyword", lambda a: a.unflatten(1, (4, 4)), [x(4, 16)], [S(1)], aten.unflatten, keywords=True)
case("expand", lambda a: a.expand(4, 3, 8), [x(4, 1, 8)], [S(2)], aten.expand)
case("expand-minus-one", lambda a: a.expand(-1, 3, -1), [x(4, 1, 8)], [S(0)], aten.expand)
case("expand-new-dims", lambda a: a.expand(3, 8), [x(8)], [S(0)], aten.expand)
case("expand-keyword", lambda a: a.expand(4, 3, 8), [x(4, 1, 8)], [S(2)], aten.expand, keywords=True)
case("unsqueeze-0", lambda a: a.unsqueeze(0), [x(4, 8)], [S(1)], aten.unsqueeze)
case("unsqueeze-negative", lambda a: a.unsqueeze(-1), [x(4, 8)], [S(1)], aten.unsqueeze)
case("unsqueeze-keyword", lambda a: a.unsqueeze(1), [x(4, 8)], [S(1)], aten.unsqueeze, keywords=True)
case("squeeze-all", lambda a: a.squeeze(), [x(4, 1, 8)], [S(2)], aten.squeeze)
case("squeeze-dim", lambda a: a.squeeze(1), [x(4, 1, 8)], [S(2)], aten.squeeze)
case("squeeze-negative", lambda a: a.squeeze(-2), [x(4, 1, 8)], [S(0)], aten.squeeze)
case("squeeze-dims", lambda a: a.squeeze((0, 2)), [x(1, 8, 1)], [S(1)], aten.squeeze)
case("squeeze-all-tp-sized", lambda a: a.squeeze(), [x(4, 2)], [S(1)], aten.squeeze)
case("squeeze-split-dim", lambda a: a.squeeze(1), [x(4, 2)], [S(1)], aten.squeeze)
case("transpose", lambda a: a.transpose(0, 2), [x(2, 4, 8)], [S(2)], aten.transpose)
case("transpose-negative", lambda a: a.transpose(-1, -2), [x(2, 4, 8)], [S(1)], aten.transpose)
case("transpose-other", lambda a: a.transpose(1, 2), [x(4, 2, 8)], [S(0)], aten.transpose)
case("transpose-keyword", lambda a: a.transpose(0, 2), [x(2, 4, 8)], [S(2)], aten.transpose, keywords=True)
case("t", lambda a: a.t(), [x(4, 8)], [S(0)], aten.t)
case("t-vector", lambda a: a.t() * 1, [x(8)], [S(0)], aten.t, "declined")
case("permute", lambda a: a.permute(2, 0, 1), [x(2, 4, 8)], [S(2)], aten.permute)
case("permute-negative", lambda a: a.permute(-1, 0, 1), [x(2, 4, 8)], [S(1)], aten.permute)
case("permute-keyword", lambda a: a.permute(2, 0, 1), [x(2, 4, 8)], [S(0)], aten.permute, keywords=True)

# ---------------------------------------------------------------- slicing, splitting, joining

case("slice", lambda a: a[:, 1:5], [x(4, 8)], [S(0)], aten.slice)
case("slice-step", lambda a: a[:, ::3], [x(4, 8)], [S(0)], aten.slice)
case("slice-split-dim", lambda a: a[:, 1:5], [x(4, 8)], [S(1)], aten.slice, "declined")
case("slice-keyword", lambda a: a[:, 1:5], [x(4, 8)], [S(0)], aten.slice, keywords=True)
case("select", lambda a: a[:, 2], [x(4, 8)], [S(0)], aten.select)
case("select-before-split", lambda a: a[1], [x(4, 8)], [S(1)], aten.select)
case("select-negative", lambda a: a.select(-1, -1), [x(2, 4, 8)], [S(1)], aten.select)
case("select-split-dim", lambda a: a[:, 3], [x(4, 8)], [S(1)], aten.select, "declined")
case("select-keyword", lambda a: a[1], [x(4, 8)], [S(1)], aten.select, keywords=True)
case("narrow", lambda a: a.narrow(1, 2, 3), [x(4, 8)], [S(0)], aten.narrow)
case("split-other-dim", lambda a: a.split(3, dim=1), [x(4, 8)], [S(0)], aten.split)
case("split-negative-dim", lambda a: a.split(3, dim=-1), [x(4, 8)], [S(0)], aten.split)
case("split-packed", lambda a: a.split(4, dim=1), [x(4, 12)], [S(1, 3)], aten.split)
case("split-packed-keyword", lambda a: a.split(4, dim=1), [x(4, 12)], [S(1, 3)], aten.split, keywords=True)
case("split-sizes-packed", lambda a: a.split([4, 4, 4], dim=-1), [x(4, 12)], [S(1, 3)], aten.split_with_sizes)
case("split-sizes-uneven", lambda a: a.split([2, 6, 4], dim=1), [x(4, 12)], [S(1, 3)], aten.split_with_sizes,
     "declined")
case("split-sizes-keyword", lambda a: a.split([4, 4, 4], dim=1), [x(4, 12)], [S(1, 3)], aten.split_with_sizes,
     keywords=True)
case("split-split-dim", lambda a: a.split(4, dim=1), [x(4, 8)], [S(1)], aten.split, "declined")
case("chunk-other-dim", lambda a: a.chunk(2, dim=0), [x(4, 8)], [S(1)], aten.chunk)
case("chunk-packed", lambda a: a.chunk(3, dim=-1), [x(4, 12)], [S(1, 3)], aten.chunk)
case("chunk-packed-uneven", lambda a: a.chunk(2, dim=-1), [x(4, 12)], [S(1, 3)], aten.chunk, "declined")
case("unbind", lambda a: a.unbind(0), [x(2, 4, 8)], [S(2)], aten.unbind)
case("unbind-after-split", lambda a: a.unbind(1), [x(4, 3)], [S(0)], aten.unbind)
case("unbind-keyword", lambda a: a.unbind(0), [x(2, 4, 8)], [S(2)], aten.unbind, keywords=True)
case("cat", lambda a, b: torch.cat([a, b], dim=0), [x(4, 8), x(2, 8)], [S(1), S(1)], aten.cat)
case("cat-negative", lambda a, b: torch.cat([a, b], dim=-2), [x(2, 4, 8), x(2, 4, 8)], [S(0), S(0)], aten.cat)
case("cat-keyword", lambda a, b: torch.cat([a, b], dim=0), [x(4, 8), x(2, 8)], [S(1), S(1)], aten.cat, keywords=True)
# along the split: the parts packed as unequal blocks, each rank [a_r, b_r] (Gated DeltaNet's q, k, v before its conv)
case("cat-split-dim", lambda a, b: torch.cat([a, b], dim=1), [x(4, 8), x(4, 4)], [S(1), S(1)], aten.cat)
case("cat-split-dim-then-whole", lambda a, b: torch.cat([a, b], dim=1) * 1, [x(4, 8), x(4, 4)], [S(1), S(1)], aten.cat)
case("cat-split-and-other-dim", lambda a, b: torch.cat([a, b], dim=1), [x(4, 8), x(4, 4)], [S(1), S(0)], aten.cat,
     "declined")
case("cat-mixed", lambda a, b: torch.cat([a, b], dim=0), [x(4, 8), x(2, 8)], [S(1), R], aten.cat)  # b sliced

# ---------------------------------------------------------------- softmax, norms, reductions

case("softmax", lambda a: torch.softmax(a, dim=-1), [x(4, 8)], [S(0)], aten.softmax)
case("softmax-dtype", lambda a: torch.softmax(a, 1, dtype=torch.float64), [x(4, 8)], [S(0)], aten.softmax)
case("softmax-split-dim", lambda a: torch.softmax(a, dim=1), [x(4, 8)], [S(1)], aten.softmax, "declined")
case("softmax-keyword", lambda a: torch.softmax(a, dim=-1), [x(4, 8)], [S(0)], aten.softmax, keywords=True)
case("log-softmax", lambda a: F.log_softmax(a, dim=0), [x(4, 8)], [S(1)], aten.log_softmax)
case("aten-softmax", lambda a: aten._softmax(a, -1, False), [x(4, 8)], [S(0)], aten._softmax)
case("aten-log-softmax-split-dim", lambda a: aten._log_softmax(a, 0, False), [x(4, 8)], [S(0)], aten._log_softmax,
     "declined")
case("layer-norm", lambda a, w, b: F.layer_norm(a, (8,), w, b), [x(4, 8), x(8), x(8)], [S(0), R, R], aten.layer_norm)
case("layer-norm-eps", lambda a: F.layer_norm(a, (4, 8), eps=0.5), [x(2, 4, 8)], [S(0)], aten.layer_norm)
case("layer-norm-keyword", lambda a, w: F.layer_norm(a, (8,), w, eps=1e-3), [x(4, 8), x(8)], [S(0), R],
     aten.layer_norm, keywords=True)
case("layer-norm-normalized-dim", lambda a: F.layer_norm(a, (4, 8)), [x(2, 4, 8)], [S(1)], aten.layer_norm, "declined")
case("layer-norm-split-weight", lambda a, w: F.layer_norm(a, (8,), w), [x(4, 8), x(8)], [S(0), S(0)], aten.layer_norm,
     "declined")
case("rms-norm", lambda a, w: F.rms_norm(a, (8,), w, eps=1e-2), [x(4, 8), x(8)], [S(0), R], aten.rms_norm)
case("rms-norm-no-eps", lambda a: F.rms_norm(a, (8,)), [x(2, 4, 8)], [S(1)], aten.rms_norm)
case("rms-norm-normalized-dim", lambda a: F.rms_norm(a, (8,)), [x(4, 8)], [S(1)], aten.rms_norm, "declined")
for name, f in [("sum", torch.sum), ("mean", torch.mean), ("amax", torch.amax), ("amin", torch.amin)]:
    op = getattr(aten, name)
    case(f"{name}-dim", lambda a, f=f: f(a, dim=1), [x(4, 8)], [S(0)], op)
    case(f"{name}-keepdim", lambda a, f=f: f(a, -1, keepdim=True), [x(4, 8)], [S(0)], op)
    case(f"{name}-dims", lambda a, f=f: f(a, dim=(0, 2)), [x(2, 4, 8)], [S(1)], op)
    case(f"{name}-before-split", lambda a, f=f: f(a, dim=0), [x(2, 4, 8)], [S(2)], op)
    # a sum over the split is a partial sum (a mean, one divided by tp); a max is not
    case(f"{name}-split-dim", lambda a, f=f: f(a, dim=1), [x(4, 8)], [S(1)], op,
         "split" if name in ("sum", "mean") else "declined")
    case(f"{name}-keyword", lambda a, f=f: f(a, dim=0, keepdim=True), [x(2, 4, 8)], [S(2)], op, keywords=True)
case("sum-all", lambda a: a.sum(), [x(4, 8)], [S(0)], aten.sum, "declined")
case("sum-empty-dims", lambda a: a.sum(dim=[]), [x(4, 8)], [S(0)], aten.sum, "declined")
case("amax-empty-dims", lambda a: a.amax(dim=[]), [x(4, 8)], [S(0)], aten.amax, "declined")
case("mean-dtype", lambda a: a.mean(1, dtype=torch.float64), [x(4, 8)], [S(0)], aten.mean)
case("sum-packed", lambda a: a.sum(0), [x(4, 12)], [S(1, 3)], aten.sum)

# ---------------------------------------------------------------- linear, addmm, matmul

case("linear-colwise", F.linear, [x(4, 8), x(8, 8), x(8)], [R, S(0), S(0)], aten.linear)
case("linear-colwise-no-bias", F.linear, [x(2, 4, 8), x(8, 8)], [R, S(0)], aten.linear)
case("linear-colwise-packed", F.linear, [x(4, 8), x(12, 8), x(12)], [R, S(0, 3), S(0, 3)], aten.linear)
case("linear-colwise-whole-bias", F.linear, [x(4, 8), x(8, 8), x(8)], [R, S(0), R], aten.linear, "declined")
case("linear-rowwise", F.linear, [x(4, 8), x(8, 8), x(8)], [S(1), S(1), R], aten.linear)
case("linear-rowwise-scatter", F.linear, [x(2, 4, 8), x(8, 8), x(8)], [R, S(1), R], aten.linear)
case("linear-rowwise-keyword", F.linear, [x(4, 8), x(8, 8), x(8)], [S(1), S(1), R], aten.linear, keywords=True)
case("linear-rowwise-packed-input", F.linear, [x(4, 12), x(8, 12), x(8)], [S(1, 3), S(1), R], aten.linear)
case("linear-rowwise-no-bias", F.linear, [x(4, 8), x(8, 8)], [S(1), S(1)], aten.linear)
case("linear-rowwise-packed", F.linear, [x(4, 12), x(8, 12)], [S(1, 3), S(1, 3)], aten.linear, "declined")
case("linear-rowwise-split-bias", F.linear, [x(4, 8), x(8, 8), x(8)], [S(1), S(1), S(0)], aten.linear, "declined")
case("linear-rows", F.linear, [x(4, 8), x(8, 8), x(8)], [S(0), R, R], aten.linear)
case("linear-rows-3d", F.linear, [x(2, 4, 8), x(8, 8), x(8)], [S(1), R, R], aten.linear)
case("linear-keyword", F.linear, [x(4, 8), x(8, 8), x(8)], [R, S(0), S(0)], aten.linear, keywords=True)


def addmm(beta=1, alpha=1):
    return lambda b, a, w: torch.addmm(b, a, w, beta=beta, alpha=alpha)


case("addmm-colwise", addmm(), [x(8), x(4, 8), x(8, 8)], [R, R, S(1)], aten.addmm)
case("addmm-colwise-split-bias", addmm(), [x(8), x(4, 8), x(8, 8)], [S(0), R, S(1)], aten.addmm)
case("addmm-colwise-full-bias", addmm(), [x(4, 8), x(4, 8), x(8, 8)], [R, R, S(1)], aten.addmm)
case("addmm-colwise-column-bias", addmm(), [x(4, 1), x(4, 8), x(8, 8)], [R, R, S(1)], aten.addmm)
case("addmm-colwise-scalar-bias", addmm(), [torch.tensor(0.5), x(4, 8), x(8, 8)], [R, R, S(1)], aten.addmm)
case("addmm-colwise-beta-alpha", addmm(0.5, 2.0), [x(8), x(4, 8), x(8, 8)], [R, R, S(1)], aten.addmm)
case("addmm-colwise-packed", addmm(), [x(12), x(4, 8), x(8, 12)], [S(0, 3), R, S(1, 3)], aten.addmm)
case("addmm-rowwise", addmm(), [x(8), x(4, 8), x(8, 8)], [R, S(1), S(0)], aten.addmm)
case("addmm-rowwise-full-bias", addmm(), [x(4, 8), x(4, 8), x(8, 8)], [R, R, S(0)], aten.addmm)
case("addmm-rowwise-scalar-bias", addmm(), [torch.tensor(0.5), x(4, 8), x(8, 8)], [R, S(1), S(0)], aten.addmm)
case("addmm-rowwise-keyword", addmm(), [x(8), x(4, 8), x(8, 8)], [R, S(1), S(0)], aten.addmm, keywords=True)
case("addmm-rowwise-beta", addmm(beta=0.5), [x(8), x(4, 8), x(8, 8)], [R, S(1), S(0)], aten.addmm, "declined")
case("addmm-rowwise-alpha", addmm(alpha=2.0), [x(8), x(4, 8), x(8, 8)], [R, S(1), S(0)], aten.addmm, "declined")
case("addmm-rowwise-beta-zero", addmm(beta=0.0), [x(8), x(4, 8), x(8, 8)], [R, S(1), S(0)], aten.addmm, "declined")
case("addmm-rows", addmm(), [x(8), x(4, 8), x(8, 8)], [R, S(0), R], aten.addmm)
case("addmm-rows-full-bias", addmm(0.5, 2.0), [x(4, 8), x(4, 8), x(8, 8)], [R, S(0), R], aten.addmm)
case("addmm-rows-unit-bias", addmm(), [x(1, 8), x(4, 8), x(8, 8)], [R, S(0), R], aten.addmm)
case("addmm-keyword", addmm(0.5, 2.0), [x(8), x(4, 8), x(8, 8)], [R, R, S(1)], aten.addmm, keywords=True)

case("mm-contracted", torch.mm, [x(4, 8), x(8, 4)], [S(1), S(0)], aten.mm)
case("mm-rows", torch.mm, [x(4, 8), x(8, 4)], [S(0), R], aten.mm)
case("mm-columns", torch.mm, [x(4, 8), x(8, 4)], [R, S(1)], aten.mm)
case("mm-packed-columns", torch.mm, [x(4, 8), x(8, 12)], [R, S(1, 3)], aten.mm)
case("mm-packed-contracted", torch.mm, [x(4, 12), x(12, 4)], [S(1, 3), S(0)], aten.mm, "declined")
case("mm-packed-both-contracted", torch.mm, [x(4, 12), x(12, 4)], [S(1, 3), S(0, 3)], aten.mm)
case("mm-crossed", torch.mm, [x(4, 8), x(8, 4)], [S(0), S(1)], aten.mm, "declined")
case("bmm-batch", torch.bmm, [x(2, 4, 8), x(2, 8, 4)], [S(0), R], aten.bmm)
case("bmm-contracted", torch.bmm, [x(2, 4, 8), x(2, 8, 4)], [S(2), S(1)], aten.bmm)
case("bmm-packed-batch", torch.bmm, [x(8, 2, 4), x(8, 4, 2)], [S(0, 2), R], aten.bmm)
case("bmm-mixed-blocks", torch.bmm, [x(8, 2, 4), x(8, 4, 2)], [S(0, 2), S(0)], aten.bmm, "declined")
case("matmul-broadcast-weight", torch.matmul, [x(2, 4, 8), x(8, 4)], [S(0), R], aten.matmul)
case("matmul-broadcast-batch", torch.matmul, [x(4, 8), x(2, 8, 4)], [R, S(0)], aten.matmul)
case("matmul-rows-3d", torch.matmul, [x(2, 4, 8), x(8, 4)], [S(1), R], aten.matmul)
case("matmul-unit-batch", torch.matmul, [x(2, 1, 4, 8), x(4, 8, 4)], [S(0), R], aten.matmul)
case("matmul-partial-operand", lambda a, w, b: torch.matmul(_psum(a, w), b), [x(4, 8), x(8, 8), x(2, 8, 4)],
     [S(1), S(0), S(0)], aten.matmul)
case("matmul-vector", torch.matmul, [x(4, 8), x(8)], [S(0), R], aten.matmul, "declined")

# ---------------------------------------------------------------- attention


def sdpa(**kw):
    return lambda q, k, v, *m: F.scaled_dot_product_attention(q, k, v, *m, **kw)


QKV = lambda heads=4, kv=4: [x(2, heads, 8, 4), x(2, kv, 8, 4), x(2, kv, 8, 4)]  # noqa: E731
SDPA = aten.scaled_dot_product_attention
case("sdpa-heads", sdpa(), QKV(), [S(1)] * 3, SDPA)
case("sdpa-batch", sdpa(), QKV(), [S(0)] * 3, SDPA)
case("sdpa-causal", sdpa(is_causal=True), QKV(), [S(1)] * 3, SDPA)
case("sdpa-scale", sdpa(scale=0.3), QKV(), [S(1)] * 3, SDPA)
case("sdpa-gqa", sdpa(enable_gqa=True), QKV(4, 2), [S(1)] * 3, SDPA)
case("sdpa-bool-mask", sdpa(), [*QKV(), mask(8, 8)], [S(1)] * 3 + [R], SDPA)
case("sdpa-float-mask-batch", sdpa(), [*QKV(), x(2, 1, 8, 8)], [S(0)] * 3 + [R], SDPA, frozen=frozenset({3}))
case("sdpa-float-mask-heads", sdpa(), [*QKV(), x(2, 4, 8, 8)], [S(1)] * 3 + [R], SDPA)
case("sdpa-split-mask", sdpa(), [*QKV(), x(1, 4, 8, 8)], [S(1)] * 4, SDPA)
case("sdpa-packed-mask", sdpa(), [*QKV(), x(1, 4, 8, 8)], [S(1)] * 3 + [S(1, 2)], SDPA, "declined")
case("sdpa-keyword", sdpa(is_causal=True, scale=0.5), QKV(), [S(1)] * 3, SDPA, keywords=True)
case("sdpa-partial-mask", lambda q, k, v, a, w: F.scaled_dot_product_attention(q, k, v, _psum(a, w)),
     [*QKV(), x(8, 8), x(8, 8)], [S(1)] * 3 + [S(1), S(0)], SDPA)
case("sdpa-sequence", sdpa(), QKV(), [S(2)] * 3, SDPA, "declined")
case("sdpa-mixed", sdpa(), QKV(), [S(1), S(1), R], SDPA, "declined")

# ---------------------------------------------------------------- embedding

VOCAB = 16
TOKENS = torch.tensor([[0, 3, 7, 8, 12], [15, 3, 3, 9, 1]])  # both halves of the vocabulary, repeats, padding 3/12
E = aten.embedding


def emb(**kw):
    return lambda i, w: F.embedding(i, w, **kw)


for name, kw in [("", {}), ("-padding-first-half", {"padding_idx": 3}), ("-padding-second-half", {"padding_idx": 12}),
                 ("-padding-negative", {"padding_idx": -4})]:
    case(f"embedding-vocab{name}", emb(**kw), [TOKENS, x(VOCAB, 4)], [R, S(0)], E)
    case(f"embedding-columns{name}", emb(**kw), [TOKENS, x(VOCAB, 4)], [R, S(1)], E)
    case(f"embedding-ids{name}", emb(**kw), [TOKENS, x(VOCAB, 4)], [S(0), R], E)
case("embedding-vocab-keyword", emb(padding_idx=12), [TOKENS, x(VOCAB, 4)], [R, S(0)], E, keywords=True)
case("embedding-vocab-freq", emb(scale_grad_by_freq=True), [TOKENS, x(VOCAB, 4)], [R, S(0)], E, "declined")
case("embedding-columns-freq", emb(scale_grad_by_freq=True), [TOKENS, x(VOCAB, 4)], [R, S(1)], E, "declined")
case("embedding-ids-freq", emb(scale_grad_by_freq=True, padding_idx=3), [TOKENS, x(VOCAB, 4)], [S(0), R], E,
     "declined")
case("embedding-vocab-sparse", emb(sparse=True), [TOKENS, x(VOCAB, 4)], [R, S(0)], E, "declined")
case("embedding-columns-sparse", emb(sparse=True, padding_idx=3), [TOKENS, x(VOCAB, 4)], [R, S(1)], E, "declined")
case("embedding-ids-sparse", emb(sparse=True), [TOKENS, x(VOCAB, 4)], [S(0), R], E, "declined")
case("embedding-ids-max-norm", emb(max_norm=1.0), [TOKENS, x(VOCAB, 4)], [S(0), R], E)
case("embedding-vocab-max-norm", emb(max_norm=1.0), [TOKENS, x(VOCAB, 4)], [R, S(0)], E, "refused")
case("embedding-columns-max-norm", emb(max_norm=1.0, norm_type=1.0), [TOKENS, x(VOCAB, 4)], [R, S(1)], E, "refused")

# ---------------------------------------------------------------- cross entropy

TARGETS = torch.tensor([0, 5, 9, 15, -100, 3, 8, 7])
CE = aten.cross_entropy_loss


def ce(**kw):
    return lambda logits, t, *w: F.cross_entropy(logits, t, *w, **kw)


case("ce-vocab-token-mean", ce(), [x(8, VOCAB), TARGETS], [S(1), R], CE, batch=frozenset({1}))
case("ce-vocab-mean", lambda a, t: F.cross_entropy(a, t) * 1.0, [x(8, VOCAB), TARGETS], [S(1), R], CE)
case("ce-vocab-sum", ce(reduction="sum"), [x(8, VOCAB), TARGETS], [S(1), R], CE)
case("ce-vocab-none", ce(reduction="none"), [x(8, VOCAB), TARGETS], [S(1), R], CE)
case("ce-vocab-ignore-class", ce(ignore_index=3), [x(8, VOCAB), TARGETS.clamp(min=0)], [S(1), R], CE,
     batch=frozenset({1}))
case("ce-vocab-ignore-class-none", ce(ignore_index=9, reduction="none"), [x(8, VOCAB), TARGETS.clamp(min=0)],
     [S(1), R], CE)
case("ce-vocab-keyword", ce(reduction="sum", ignore_index=5), [x(8, VOCAB), TARGETS.clamp(min=0)], [S(1), R], CE,
     keywords=True)
case("ce-vocab-zero-smoothing", ce(label_smoothing=0.0), [x(8, VOCAB), TARGETS], [S(1), R], CE)
case("ce-weight", ce(), [x(8, VOCAB), TARGETS, x(VOCAB).abs()], [S(1), R, R], CE, "declined", frozen=frozenset({2}))
case("ce-smoothing", ce(label_smoothing=0.1), [x(8, VOCAB), TARGETS], [S(1), R], CE, "declined")
case("ce-smoothing-sum", ce(label_smoothing=0.2, reduction="sum"), [x(8, VOCAB), TARGETS], [S(1), R], CE, "declined")
case("ce-probabilities", ce(), [x(8, VOCAB), x(8, VOCAB).softmax(-1)], [S(1), R], CE, "declined",
     frozen=frozenset({1}))
case("ce-spatial", ce(), [x(2, VOCAB, 4), ids(VOCAB, 2, 4)], [S(1), R], CE, "declined")
case("ce-packed", ce(), [x(8, VOCAB), TARGETS], [S(1, 2), R], CE, "declined")
case("ce-batch-split", ce(), [x(8, VOCAB), TARGETS], [S(0), R], CE, "declined")

# ---------------------------------------------------------------- factories shaped like an input

for name, f, op in [("zeros-like", torch.zeros_like, aten.zeros_like), ("ones-like", torch.ones_like, aten.ones_like),
                    ("full-like", lambda a: torch.full_like(a, 3.0), aten.full_like),
                    ("new-zeros", lambda a: a.new_zeros(3, 4), aten.new_zeros),
                    ("new-full", lambda a: a.new_full((3, 4), 2.0), aten.new_full)]:
    case(f"{name}", lambda a, f=f: f(a) * 2, [x(4, 8)], [S(1)], op)
for name, f, op in [("zeros-like", torch.zeros_like, aten.zeros_like), ("ones-like", torch.ones_like, aten.ones_like),
                    ("full-like", lambda a: torch.full_like(a, 3.0), aten.full_like)]:
    case(f"{name}-partial", lambda a, w, f=f: f(_psum(a, w)), [x(4, 8), x(8, 8)], [S(1), S(0)], op)



def _filled(a, b):
    """DeepSeek-V3's MLA keys: ``new_empty`` shaped like the heads' keys, filled by ``copy_`` into two slices, one from
    the split heads, one from a key part every head shares (whole, expanded over the heads)."""
    buf = a.new_empty(a.shape[0], a.shape[1], a.shape[2], 6)
    buf[..., :4].copy_(a)
    buf[..., 4:].copy_(b.expand(-1, a.shape[1], -1, -1))
    return buf * 1


# whole pieces beside split ones (GPT-OSS's attention sinks beside the heads' scores): the whole ones sliced
case("cat-whole-beside-split", lambda a, b: torch.cat([a, b], dim=-1), [x(2, 8, 4), x(2, 8, 2)], [S(1), R], aten.cat)
case("cat-whole-along-split", lambda a, b: torch.cat([a, b], dim=1), [x(2, 8, 4), x(2, 4, 4)], [S(1), R], aten.cat,
     "declined")
# a max along another dimension than the split, values and indices (GPT-OSS's softmax with sinks)
case("max-dim-other", lambda a: a - a.max(dim=-1, keepdim=True).values, [x(2, 8, 4)], [S(1)], aten.max)
case("max-dim-indices", lambda a: a.max(dim=2).values * 2 + a.min(dim=2).indices, [x(2, 8, 4)], [S(1)], aten.max)
case("max-dim-split", lambda a: a.max(dim=1).values * 2, [x(2, 8, 4)], [S(1)], aten.max, "declined")
case("new-empty-filled-by-copies", _filled, [x(2, 8, 4, 4), x(2, 1, 4, 2)], [S(1), R], aten.new_empty)
case("copy-into-split-buffer", _filled, [x(2, 8, 4, 4), x(2, 1, 4, 2)], [S(1), R], aten.copy_)
case("new-empty-own-size", lambda a: a.new_empty(3, 4).fill_(1.0) * 2, [x(4, 8)], [S(1)], aten.new_empty)

# ---------------------------------------------------------------- splits of unequal blocks, parts held by several ranks

U = S(0, 3, sizes=(8, 8, 4))  # a packed projection of unequal blocks (a Mamba-2 in_proj's z, x, dt)
UW = S(0, 3, sizes=(8, 8, 4), parts=(0, 0, 1))  # its last block whole on every rank (B and C under fewer groups)
case("linear-colwise-uneven", F.linear, [x(4, 8), x(20, 8), x(20)], [R, U, U], aten.linear)
case("linear-colwise-whole-block", F.linear, [x(4, 8), x(20, 8), x(20)], [R, UW, UW], aten.linear)
case("linear-colwise-parts", F.linear, [x(2, 4, 8), x(8, 8)], [R, S(0, parts=(1,))], aten.linear)
case("linear-colwise-two-parts", F.linear, [x(2, 4, 8), x(8, 8)], [R, S(0, parts=(2,))], aten.linear)
case("split-uneven-blocks", lambda a: a.split([16, 4], dim=1), [x(4, 20)], [S(1, 3, sizes=(8, 8, 4))],
     aten.split_with_sizes)
case("split-uneven-each", lambda a: a.split([8, 8, 4], dim=1), [x(4, 20)], [S(1, 3, sizes=(8, 8, 4), parts=(0, 0, 1))],
     aten.split_with_sizes)
case("split-uneven-cuts-a-block", lambda a: a.split([4, 16], dim=1), [x(4, 20)], [S(1, 3, sizes=(8, 8, 4))],
     aten.split_with_sizes, "declined")
case("mul-uneven-beside-whole", lambda a, b: a * b, [x(4, 20), x(4, 20)], [S(1, 3, sizes=(8, 8, 4)), R], aten.mul)
case("mul-uneven-beside-buffer", lambda a, b: a * b, [x(4, 20), x(1, 20)],
     [S(1, 3, sizes=(8, 8, 4), parts=(0, 0, 1)), R],
     aten.mul, frozen=frozenset({1}))
case("mul-parts-beside-split", lambda a, b: a * b, [x(4, 8), x(4, 8)], [S(1), S(1, parts=(1,))], aten.mul)
case("view-parts-one-group", lambda a: a.view(4, 1, 8), [x(4, 8)], [S(1, parts=(1,))], aten.view)
case("view-parts-groups", lambda a: a.view(4, 2, 4), [x(4, 8)], [S(1, parts=(2,))], aten.view)
case("view-uneven-kept", lambda a: a.view(2, 2, 20), [x(4, 20)], [S(1, 3, sizes=(8, 8, 4))], aten.view)
case("softmax-uneven-declined", lambda a: torch.softmax(a, 0), [x(4, 20)], [S(1, 3, sizes=(8, 8, 4))], aten.softmax,
     "declined")  # a rule written for ordinary splits sees the split gathered
Q4, KV1 = x(2, 4, 8, 4), [x(2, 1, 8, 4), x(2, 1, 8, 4)]  # one key/value head for four query heads (MQA)
KV = S(1, parts=(1,))
case("sdpa-gqa-whole-kv", sdpa(enable_gqa=True), [Q4, *KV1], [S(1), KV, KV], SDPA)
case("sdpa-repeated-kv", lambda q, k, v: F.scaled_dot_product_attention(
    q, k[:, :, None].expand(2, 1, 4, 8, 4).reshape(2, 4, 8, 4),
    v[:, :, None].expand(2, 1, 4, 8, 4).reshape(2, 4, 8, 4)),
    [Q4, *KV1], [S(1), KV, KV], SDPA)
KV2 = [x(2, 2, 8, 4), x(2, 2, 8, 4)]  # two key/value heads: over tp=4, each held by two ranks
case("sdpa-gqa-two-kv-heads", sdpa(enable_gqa=True), [Q4, *KV2], [S(1), S(1, parts=(2,)), S(1, parts=(2,))], SDPA)

# ---------------------------------------------------------------- the ops of state-space and linear-attention mixers


def conv(groups, padding=2):
    return lambda a, w, *b: F.conv1d(a, w, *b, padding=padding, groups=groups)


C1 = aten.conv1d
case("conv1d-depthwise", conv(8), [x(2, 8, 6), x(8, 1, 3), x(8)], [S(1), S(0), S(0)], C1)
case("conv1d-depthwise-whole-weight", conv(8), [x(2, 8, 6), x(8, 1, 3)], [S(1), R], C1)
case("conv1d-grouped", conv(4), [x(2, 8, 6), x(8, 2, 3), x(8)], [S(1), S(0), S(0)], C1)
case("conv1d-depthwise-uneven", conv(12), [x(2, 12, 6), x(12, 1, 3), x(12)],
     [S(1, 2, sizes=(8, 4))] + [S(0, 2, sizes=(8, 4))] * 2, C1)
case("conv1d-depthwise-whole-block", conv(12), [x(2, 12, 6), x(12, 1, 3), x(12)],
     [S(1, 2, sizes=(8, 4), parts=(0, 1))] + [S(0, 2, sizes=(8, 4), parts=(0, 1))] * 2, C1)
case("conv1d-ungrouped", conv(1), [x(2, 8, 6), x(8, 8, 3)], [S(1), R], C1, "declined")
case("conv1d-split-length", conv(8), [x(2, 8, 8), x(8, 1, 3)], [S(2), R], C1, "declined")
# Mamba-1's dt_proj read through a product (``dt_proj.weight @ time_step``): the weight's rows split, the batch
# broadcast
case("matmul-broadcast-weight-rows", torch.matmul, [x(8, 4), x(2, 4, 5)], [S(0), R], aten.matmul)
case("softplus", F.softplus, [x(2, 8, 4)], [S(1)], aten.softplus)
case("stack-new-dim-after", lambda a, b: torch.stack([a, b], dim=-1), [x(2, 8), x(2, 8)], [S(1), S(1)], aten.stack)
case("stack-new-dim-before", lambda a, b: torch.stack([a, b], dim=0), [x(2, 8), x(2, 8)], [S(1), S(1)], aten.stack)
case("stack-mixed", lambda a, b: torch.stack([a, b], dim=0), [x(2, 8), x(2, 8)], [S(1), R], aten.stack, "declined")
case("cumsum", lambda a: a.cumsum(1), [x(4, 8)], [S(0)], aten.cumsum)
case("cumsum-split-dim", lambda a: a.cumsum(1), [x(4, 8)], [S(1)], aten.cumsum, "declined")
case("cumprod", lambda a: a.cumprod(-1) * 1, [x(4, 4, 4)], [S(1)], aten.cumprod)
case("pad-other-dims", lambda a: F.pad(a, (0, 0, 1, 3)), [x(4, 4, 8)], [S(0)], aten.pad)
case("pad-split-dim", lambda a: F.pad(a, (0, 0, 1, 3)), [x(2, 4, 8)], [S(1)], aten.pad, "declined")
case("tril", lambda a: a.tril(-1) * 1, [x(4, 4, 4)], [S(0)], aten.tril)
case("triu-split-dim", lambda a: a.triu(1) * 1, [x(4, 4, 4)], [S(2)], aten.triu, "declined")
RI = aten.repeat_interleave
case("repeat-interleave-heads", lambda a: a.repeat_interleave(2, dim=1, output_size=8), [x(2, 4, 8)], [S(1)], RI)
case("repeat-interleave-other-dim", lambda a: a.repeat_interleave(2, dim=1), [x(2, 4, 8)], [S(2)], RI)
case("repeat-interleave-one-group", lambda a: a.repeat_interleave(4, dim=1, output_size=4), [x(2, 1, 8)],
     [S(1, parts=(1,))], RI)
case("repeat-interleave-two-groups", lambda a: a.repeat_interleave(2, dim=1, output_size=4), [x(2, 2, 8)],
     [S(1, parts=(2,))], RI)
EI = aten.einsum
case("einsum-heads", lambda a, b: torch.einsum("blhn,bshn->blsh", a, b), [x(2, 4, 4, 3), x(2, 4, 4, 3)],
     [S(2), S(2)], EI)
case("einsum-heads-whole-operand", lambda a, b: torch.einsum("blhn,bshn->blsh", a, b), [x(2, 4, 4, 3), x(2, 4, 4, 3)],
     [S(2), R], EI)
case("einsum-broadcast-operand", lambda a, b: torch.einsum("bhls,bsp->bhlp", a, b), [x(2, 4, 3, 3), x(2, 3, 5)],
     [S(1), R], EI)
case("einsum-summed-letter", lambda a, b: torch.einsum("bhn,bhm->bnm", a, b), [x(2, 4, 3), x(2, 4, 5)],
     [S(1), S(1)], EI)
case("einsum-crossed-letters", lambda a, b: torch.einsum("bhn,bhm->bhnm", a, b), [x(2, 4, 4), x(2, 4, 4)],
     [S(1), S(2)], EI, "declined")
case("einsum-parts-summed", lambda a, b: torch.einsum("bhn,bhm->bnm", a, b), [x(2, 4, 3), x(2, 4, 5)],
     [S(1, parts=(1,)), S(1, parts=(1,))], EI, "declined")
case("baddbmm-heads", lambda b, a, w: torch.baddbmm(b, a, w), [x(4, 1, 3), x(4, 5, 3), x(4, 3, 3)],
     [S(0), S(0), S(0)], aten.baddbmm)
case("baddbmm-whole-bias", lambda b, a, w: torch.baddbmm(b, a, w), [x(4, 1, 3), x(4, 5, 3), x(4, 3, 3)],
     [R, S(0), S(0)], aten.baddbmm)


def grouped_norm(groups):  # a gated RMSNorm's variance over groups of channels (Mamba-2's MambaRMSNormGated)
    def f(a):
        g = a.view(2, 4, groups, 8 // groups)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)).view(2, 4, 8)
    return f


case("grouped-norm-local", grouped_norm(4), [x(2, 4, 8)], [S(2)], aten.mean)
case("grouped-norm-one-group", grouped_norm(1), [x(2, 4, 8)], [S(2)], aten.mean)

# ---------------------------------------------------------------- tp=4: a few of the above over four ranks

CASES_4 = [c for c in CASES if c.key in {
    "new-empty-filled-by-copies", "cat-whole-beside-split", "max-dim-other",
    "gelu-packed", "view-heads", "unflatten-split-dim", "split-packed", "linear-colwise", "linear-rowwise",
    "addmm-rowwise-full-bias", "mm-packed-both-contracted", "sdpa-heads", "embedding-vocab-padding-first-half",
    "embedding-columns-padding-second-half", "ce-vocab-ignore-class", "ce-vocab-none", "squeeze-dims",
    "sum-split-dim", "mean-split-dim", "cat-split-dim",
    # every rule and split of the mixers at tp=4 (two-part cases cut parts over pairs of ranks here)
    "linear-colwise-uneven", "linear-colwise-whole-block", "linear-colwise-parts", "linear-colwise-two-parts",
    "split-uneven-blocks", "split-uneven-each", "mul-uneven-beside-whole", "mul-uneven-beside-buffer",
    "mul-parts-beside-split", "view-parts-one-group", "view-parts-groups", "view-uneven-kept", "sdpa-gqa-whole-kv",
    "sdpa-repeated-kv", "sdpa-gqa-two-kv-heads", "conv1d-depthwise", "conv1d-depthwise-whole-weight", "conv1d-grouped",
    "conv1d-depthwise-uneven", "conv1d-depthwise-whole-block", "matmul-broadcast-weight-rows", "softplus",
    "stack-new-dim-after", "stack-new-dim-before", "cumsum", "cumprod", "pad-other-dims", "tril",
    "repeat-interleave-heads", "repeat-interleave-other-dim", "repeat-interleave-one-group",
    "repeat-interleave-two-groups", "einsum-heads", "einsum-heads-whole-operand", "einsum-broadcast-operand",
    "einsum-summed-letter", "baddbmm-heads", "baddbmm-whole-bias", "grouped-norm-local", "grouped-norm-one-group"}]
