"""Collectives the generated code calls, each correct under autograd (Megatron semantics).

=============  =======================  ==========================
function       forward                  backward
=============  =======================  ==========================
copy_to        identity                 all-reduce (sum)
all_reduce     all-reduce (sum)         identity
all_gather     all-gather along dim     keep this rank's part
scatter        keep this rank's part    all-gather along dim
reduce_scatter reduce-scatter along dim all-gather along dim
gather_to      all-gather along dim     reduce-scatter along dim
copy_to_linears copy_to + its column-   all-reduce of the input gradient, started before the weight
               parallel linears         gradients are computed and waited for after them (overlap)
batch_mean     all-reduce, / all rows   x n / all rows (DDP averages)
=============  =======================  ==========================

``reduce_scatter`` and ``gather_to`` are sequence parallelism's pair (Megatron-LM's
``reduce_scatter_to_sequence_parallel_region`` / ``gather_from_sequence_parallel_region``): the first
replaces the all-reduce after a row-parallel layer, the second the identity before a column-parallel one;
together they move the bytes of the all-reduce they replace.

``copy_to_linears`` is ``copy_to`` fused with the column-parallel linears that read its output
(``passes/overlap.py``), Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``: in backward it
computes the input gradient first, starts its all-reduce asynchronously, computes the weight and bias
gradients while the all-reduce runs, and waits for it last.  Same bytes, same values (the gradients are the
ones autograd's linear backward computes, summed in the order autograd would sum them).

``shard`` keeps this rank's part of a tensor that needs no gradient (no communication).
A collective that does not complete within the process group's timeout raises an error naming the
rank, the group, the collective and the line of the generated file that issued it (see
``fxshard.runtime.guard``); the backward of ``copy_to`` and ``scatter`` names the forward's line.

Under ``torch.compile`` (``fxshard run --compile``) the same functions trace as functional collectives
(``torch.distributed._functional_collectives``: one graph node each, an op and its ``wait_tensor``), inside
the same autograd Functions, so a rank's forward and backward each compile to one graph and the Megatron
semantics above are kept (the expert exchanges of ``--ep``, whose sizes are the routing's, are the exception:
graph breaks, see :mod:`fxshard.runtime.experts`).  The ``guarded`` wrapper (Python around each call) cannot live in a graph: a
collective that fails there raises torch's own error after the process group's timeout, which the training
step turns into one naming the rank, the step and the group (``guard.named_phase``), without the line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from fxshard.runtime.guard import call_site as _site
from fxshard.runtime.guard import guarded
from fxshard.runtime.slices import SliceSpec, place, take


def _dense(x: torch.Tensor) -> torch.Tensor:
    """A gradient as a strided tensor: ``Embedding(sparse=True)``, looked up whole (its rule declines the
    split), gives its weight a sparse one, which the collectives' backwards slice and sum."""
    return x.to_dense() if x.is_sparse else x


def _compiling() -> bool:
    """Whether dynamo is tracing this call (``fxshard run --compile``): use functional collectives."""
    return torch.compiler.is_compiling()


def _all_reduce(x: torch.Tensor, group, what: str, site=None) -> torch.Tensor:
    if _compiling():
        return funcol.all_reduce(_dense(x).contiguous(), "sum", group)
    x = _dense(x).contiguous().clone()
    with guarded(what, group, x, site):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int, blocks: int, what: str, site=None) -> torch.Tensor:
    world = dist.get_world_size(group)
    if _compiling():
        return _functional_all_gather(x, group, dim % x.dim(), blocks, world)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    with guarded(what, group, x, site):
        dist.all_gather(parts, x.contiguous(), group=group)
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    # each rank holds [b0_r, b1_r, ...]: put its blocks back where they sit in [b0_0, b0_1, ..., b1_0, ...]
    full = x.new_empty([s * world if d == dim else s for d, s in enumerate(x.shape)])
    for r, p in enumerate(parts):
        place(full, p, SliceSpec(dim, r, world, blocks))
    return full


def _functional_all_gather(x: torch.Tensor, group, dim: int, blocks: int, world: int) -> torch.Tensor:
    """:func:`_all_gather` as one functional all-gather (along dim 0) and copies, which dynamo traces."""
    parts = funcol.all_gather_tensor(x.contiguous(), 0, group).chunk(world, 0)
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    # [..., blocks, world, part, ...]: block b of every rank in rank order, then the next block
    return torch.stack([p.unflatten(dim, (blocks, -1)) for p in parts], dim=dim + 1).flatten(dim, dim + 2)


def _reduce_scatter(x: torch.Tensor, group, dim: int, blocks: int, what: str, site=None) -> torch.Tensor:
    x = _dense(x)
    dim %= x.dim()
    if blocks > 1:  # rank r keeps part r of each block: [b0_r, b1_r, ...], as SliceSpec's blocks
        x = x.unflatten(dim, (blocks, -1))
    if _compiling():
        out = funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim + (blocks > 1), group)
        return out.flatten(dim, dim + 1) if blocks > 1 else out
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim=dim + (blocks > 1))]
    out = torch.empty_like(parts[0])
    with guarded(what, group, x, site):
        dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out.flatten(dim, dim + 1) if blocks > 1 else out


def _take(x: torch.Tensor, dim: int, index: int, parts: int, blocks: int) -> torch.Tensor:
    return take(x, SliceSpec(dim, index, parts, blocks)).contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "all_reduce (backward of copy_to)", ctx.site), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        return _all_reduce(x, group, "all_reduce", site)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _BatchMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rows, site):
        n = dist.get_world_size(group)
        if isinstance(rows, torch.Tensor):  # a counted number of rows (a mask's sum): summed with the sums, one call
            both = _all_reduce(torch.cat([x.reshape(-1), rows.reshape(1).to(x.dtype)]), group,
                               "all_reduce (whole-batch mean)", site)
            x_sum, total = both[:-1].view_as(x), both[-1]
        else:  # the same number of rows on every rank (the batch splits evenly over dp)
            x_sum, total = _all_reduce(x, group, "all_reduce (whole-batch mean)", site), rows * n
        ctx.scale = n / total
        return x_sum / total

    @staticmethod
    def backward(ctx, grad):
        # d mean / d x is 1/total on one device; DDP then averages the ranks' gradients (divides by n)
        return grad * ctx.scale, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, blocks, site):
        ctx.group, ctx.dim, ctx.blocks = group, dim, blocks
        return _all_gather(x, group, dim, blocks, "all_gather", site)

    @staticmethod
    def backward(ctx, grad):
        index, parts = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return _take(_dense(grad), ctx.dim, index, parts, ctx.blocks), None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, index, parts, blocks, site):
        ctx.group, ctx.dim, ctx.blocks, ctx.site = group, dim, blocks, site
        return _take(x, dim, index, parts, blocks)

    @staticmethod
    def backward(ctx, grad):
        gathered = _all_gather(grad, ctx.group, ctx.dim, ctx.blocks, "all_gather (backward of scatter)", ctx.site)
        return gathered, *([None] * 6)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, blocks, site):
        ctx.group, ctx.dim, ctx.blocks, ctx.site = group, dim, blocks, site
        return _reduce_scatter(x, group, dim, blocks, "reduce_scatter", site)

    @staticmethod
    def backward(ctx, grad):
        gathered = _all_gather(grad, ctx.group, ctx.dim, ctx.blocks, "all_gather (backward of reduce_scatter)",
                               ctx.site)
        return gathered, None, None, None, None


class _GatherTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, blocks, site):
        ctx.group, ctx.dim, ctx.blocks, ctx.site = group, dim, blocks, site
        return _all_gather(x, group, dim, blocks, "all_gather", site)

    @staticmethod
    def backward(ctx, grad):
        what = "reduce_scatter (backward of gather_to)"
        return _reduce_scatter(grad, ctx.group, ctx.dim, ctx.blocks, what, ctx.site), None, None, None, None


class _CopyToLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site, n, *weights_and_biases):
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.group, ctx.site, ctx.biases = group, site, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        flat = [g.reshape(-1, g.shape[-1]) for g in grads]
        # the input gradient first, summed as autograd sums what the linears send it: the last linear's first
        dx = None
        for g, w in reversed(list(zip(flat, weights, strict=True))):
            part = g.mm(w)
            dx = part if dx is None else dx + part
        dx = dx.reshape(x.shape)
        x2 = x.reshape(-1, x.shape[-1])
        with guarded("all_reduce (backward of copy_to_linears, overlapped with the weight gradients)", ctx.group,
                     dx, ctx.site):
            work = dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True)  # start
            dw = [x2.t().mm(g).t() for g in flat]  # what autograd's addmm backward computes, while it runs
            db = [g.sum(0) if has else None for g, has in zip(flat, ctx.biases, strict=True)]
            work.wait()
        return dx, None, None, None, *dw, *db


def copy_to_linears(x: torch.Tensor, group, weights: tuple, biases: tuple) -> tuple[torch.Tensor, ...]:
    """``copy_to(x)`` and ``linear(·, weights[i], biases[i])`` for each i, fused so that backward overlaps the
    input gradient's all-reduce with the weight gradients (see the module docstring).  Under torch.compile,
    ``copy_to`` and the linears, for the compiler to schedule."""
    if _compiling():
        x = copy_to(x, group)
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    return _CopyToLinears.apply(x, group, _site(), len(weights), *weights, *biases)


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return _CopyTo.apply(x, group, None if _compiling() else _site())


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results over ``group``; the gradient passes through unchanged."""
    return _AllReduce.apply(x, group, None if _compiling() else _site())


def batch_mean(x: torch.Tensor, group, rows) -> torch.Tensor:
    """The mean over the whole batch of per-row values whose sum over this rank's ``rows`` rows is ``x``: the sums
    (and a counted ``rows`` tensor) all-reduced over ``group`` (dp), divided by the rows of all ranks.  Backward:
    n / (all rows) times the gradient, which DDP's average over the n ranks makes the single-device 1 / (all rows).
    Mixture-of-experts load-balancing losses use it for their whole-batch means (passes/router_loss.py)."""
    return _BatchMean.apply(x, group, rows, _site())


def all_gather(x: torch.Tensor, group, dim: int, blocks: int = 1) -> torch.Tensor:
    """Concatenate every rank's part along ``dim``; backward keeps this rank's part of the gradient."""
    return _AllGather.apply(x, group, dim, blocks, None if _compiling() else _site())


def scatter(x: torch.Tensor, group, dim: int, index: int, parts: int, blocks: int = 1) -> torch.Tensor:
    """Keep part ``index`` of ``parts`` along ``dim``; backward all-gathers the gradient."""
    return _Scatter.apply(x, group, dim, index, parts, blocks, None if _compiling() else _site())


def reduce_scatter(x: torch.Tensor, group, dim: int, blocks: int = 1) -> torch.Tensor:
    """Sum partial results over ``group`` and keep this rank's part along ``dim`` (of each of ``blocks`` equal
    blocks); backward all-gathers the gradient."""
    return _ReduceScatter.apply(x, group, dim, blocks, None if _compiling() else _site())


def gather_to(x: torch.Tensor, group, dim: int, blocks: int = 1) -> torch.Tensor:
    """Enter a tensor-parallel region from a split value: all-gather along ``dim`` forward; backward sums the
    ranks' gradients and keeps this rank's part (a reduce-scatter)."""
    return _GatherTo.apply(x, group, dim, blocks, None if _compiling() else _site())


def shard(x: torch.Tensor, dim: int, index: int, parts: int, blocks: int = 1) -> torch.Tensor:
    """Keep part ``index`` of ``parts`` of a tensor that carries no gradient (no communication)."""
    return _take(x, dim, index, parts, blocks)


COLLECTIVES = {"copy_to": copy_to, "all_reduce": all_reduce, "all_gather": all_gather, "scatter": scatter,
               "reduce_scatter": reduce_scatter, "gather_to": gather_to, "copy_to_linears": copy_to_linears}
__all__ = [*COLLECTIVES, "batch_mean", "shard"]
