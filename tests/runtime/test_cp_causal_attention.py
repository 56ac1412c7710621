"""Tier 1: ``rt.cp_causal_attention`` is causal attention over the whole sequence, rank by rank, forward and backward.

Each cp rank's queries (its load-balanced chunks, in the cp order) attend over every key and value (as the
all-gather gives them, in the cp order); the ranks' outputs, put back in the natural order, and the gradients of
q, k and v summed over the ranks (what the gather's reduce-scatter does), match torch's own
``scaled_dot_product_attention(is_causal=True)`` of the whole sequence.  The group is a stand-in with ``rank`` and
``size``: the function reads nothing else of it and communicates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fxshard.runtime.context_parallel import cp_causal_attention, load_balanced_order


@dataclass
class _Group:
    rank: int
    size: int


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_blocks_merged_by_log_sum_exp_are_causal_attention(parts):
    torch.manual_seed(0)
    b, heads, kv_heads, length, width, scale = 2, 4, 2, 32, 8, 0.3
    q = torch.randn(b, heads, length, width, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, length, width, requires_grad=True) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=scale)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)

    order = load_balanced_order(length, parts)
    rows = length // parts
    total = 0
    for rank in range(parts):
        mine = order[rank * rows:(rank + 1) * rows]
        out = cp_causal_attention(q[:, :, mine], _Group(rank, parts), k[:, :, order], v[:, :, order], scale)
        torch.testing.assert_close(out, want[:, :, mine], rtol=1e-5, atol=1e-5)
        total = total + (out * grad[:, :, mine]).sum()
    for got, ref in zip(torch.autograd.grad(total, (q, k, v)), want_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_cp_order_made_under_a_fake_trace_is_not_kept_for_real_runs():
    """The compile's plan and checks run cp's functions on fake tensors; the order they make there must not be what a
    later run in the same process (or a worker forked from it) reads: it was, and ``fxshard verify --cp 2`` with
    forked workers failed (a data-dependent error eager, SIGSEGV under --compile)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxshard.runtime import context_parallel as rcp

    with FakeTensorMode():
        fake = rcp.load_balanced_order(28, 2)
    assert type(fake) is not torch.Tensor
    real = rcp.load_balanced_order(28, 2)
    assert type(real) is torch.Tensor and real.tolist() == [*range(7), *range(21, 28), *range(7, 21)]
