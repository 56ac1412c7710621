"""Expert parallelism at run time: the token exchange of a mixture-of-experts layer, and its gradients.

A rank file under ``--ep N`` keeps the model's own router and its own expert computation (the grouped
matmuls, the activation), and puts three calls around the expert computation (see
``passes/expert_parallel.py``)::

    recv_counts = rt.exchange_counts(offsets, self.ep)           # [ep, E/ep]: rows each rank sends me, per expert
    x = rt.all_to_all_dispatch(rows, self.ep, offsets, recv_counts)  # my experts' rows, grouped by expert
    offs = rt.expert_offsets(recv_counts)                          # the grouped matmul's offsets, my experts
    ...the model's expert computation with this rank's E/ep experts...
    y = rt.all_to_all_combine(out, self.ep, offsets, recv_counts)  # the rows back, in the sender's order

``offsets`` is the model's own cumulative row count per expert (rows sorted by expert), so the rows for
ep rank r are contiguous: experts ``r * E/ep`` to ``(r + 1) * E/ep - 1``.  Dropless: every row is sent and
comes back.  The backward of a dispatch is the combine's forward on the gradient and vice versa.

Expert parameters differ across the ranks of an ep group, so data parallelism does not average them over dp:
:func:`sync_expert_grads` sums their gradients over the ranks holding the same experts (``edp``) and divides by
dp, the normalization DDP gives every other parameter.

Under ``torch.compile`` (``fxshard run --compile``) the three exchanges are not traced: how many rows travel is
data (the routing), which one static graph cannot hold, so each is marked :func:`torch.compiler.disable` and runs
eagerly, as here, between compiled regions (a graph break at each).  The rows a dispatch returns are marked
dynamic in their first dimension, so the region after it compiles once for any number of rows from 2 up instead
of on every new routing (0 and 1 rows, which torch specializes, compile the region once more each, the first
time a rank's experts get them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxshard.runtime.guard import call_site as _site
from fxshard.runtime.guard import guarded


def _per_expert(offsets: torch.Tensor) -> torch.Tensor:
    """Rows per expert from the cumulative counts (int64)."""
    offsets = offsets.to(torch.int64)
    return torch.diff(offsets, prepend=offsets.new_zeros(1))


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group, what: str, site) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with guarded(what, group, x, site):
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _splits(offsets: torch.Tensor, recv_counts: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    """Rows sent to each ep rank, rows received from each, and the permutation that takes the received rows
    (by source rank, then local expert) to local-expert order (by local expert, then source rank)."""
    ep, local = recv_counts.shape
    send = _per_expert(offsets).view(ep, local).sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    start = torch.cumsum(recv_counts.flatten(), 0) - recv_counts.flatten()
    start = start.view(ep, local)
    order = [torch.arange(int(start[s, e]), int(start[s, e] + recv_counts[s, e]), dtype=torch.int64)
             for e in range(local) for s in range(ep)]
    perm = torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)
    return send, recv, perm.to(recv_counts.device)


def _dispatch(x, offsets, recv_counts, group, what, site):
    send, recv, perm = _splits(offsets, recv_counts)
    return _all_to_all(x, send, recv, group, what, site)[perm]


def _combine(y, offsets, recv_counts, group, what, site):
    send, recv, perm = _splits(offsets, recv_counts)
    by_source = torch.empty_like(y)
    by_source[perm] = y
    return _all_to_all(by_source, recv, send, group, what, site)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, recv_counts, group, site):
        ctx.save_for_backward(offsets, recv_counts)
        ctx.group, ctx.site = group, site
        return _dispatch(x, offsets, recv_counts, group, "all_to_all (dispatch)", site)

    @staticmethod
    def backward(ctx, grad):
        offsets, recv_counts = ctx.saved_tensors
        back = _combine(grad, offsets, recv_counts, ctx.group, "all_to_all (backward of dispatch)", ctx.site)
        return back, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, offsets, recv_counts, group, site):
        ctx.save_for_backward(offsets, recv_counts)
        ctx.group, ctx.site = group, site
        return _combine(y, offsets, recv_counts, group, "all_to_all (combine)", site)

    @staticmethod
    def backward(ctx, grad):
        offsets, recv_counts = ctx.saved_tensors
        back = _dispatch(grad, offsets, recv_counts, ctx.group, "all_to_all (backward of combine)", ctx.site)
        return back, None, None, None, None


@torch.compiler.disable  # a graph break under --compile: see the module docstring
def exchange_counts(offsets: torch.Tensor, group) -> torch.Tensor:
    """``[ep, E/ep]`` int64: how many rows each rank of ``group`` sends to each of this rank's experts, from the
    model's cumulative rows per expert ``offsets`` (``[E]``) on every rank (an all-to-all of the counts)."""
    ep = dist.get_world_size(group)
    counts = _per_expert(offsets.detach()).to(offsets.dtype)  # sent in the offsets' dtype, as the header states
    out = torch.empty_like(counts)
    with guarded("all_to_all (counts)", group, counts, _site()):
        dist.all_to_all_single(out, counts, group=group)
    return out.to(torch.int64).view(ep, -1)


@torch.compiler.disable
def all_to_all_dispatch(x: torch.Tensor, group, offsets: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """Send each row of ``x`` (sorted by expert, ``offsets`` its cumulative counts) to the rank holding its expert;
    return the rows this rank's experts get, grouped by local expert.  Backward: the gradient's way back."""
    rows = _Dispatch.apply(x, offsets, recv_counts, group, _site())
    torch._dynamo.maybe_mark_dynamic(rows, 0)  # a compiled region reading it: any number of rows, one graph
    return rows


@torch.compiler.disable
def all_to_all_combine(y: torch.Tensor, group, offsets: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`all_to_all_dispatch`: this rank's expert outputs back to the ranks their rows came
    from, in each sender's original (sorted-by-expert) order.  Backward: the gradient dispatched again."""
    return _Combine.apply(y, offsets, recv_counts, group, _site())


def expert_offsets(recv_counts: torch.Tensor) -> torch.Tensor:
    """Cumulative rows per local expert (int32, as the model's grouped matmul takes them) of the dispatched rows."""
    return torch.cumsum(recv_counts.sum(0), 0, dtype=torch.int32)


def sync_expert_grads(params: list[torch.nn.Parameter], edp_group, dp: int) -> None:
    """Sum expert gradients over the ranks holding the same experts and divide by dp: with the all-to-all's
    backward (which brought every ep rank's contribution), the sum over all dp ranks that DDP averages the
    other parameters by.  One flat buffer in fp32 (bf16 gradients are summed and divided there, then rounded
    once), one all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    if dist.get_world_size(edp_group) > 1:
        with guarded("all_reduce of the expert gradients over edp", edp_group, flat, None):
            dist.all_reduce(flat, group=edp_group)
    flat.div_(dp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()

