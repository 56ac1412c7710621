"""Collectives the generated code calls, each correct under autograd (Megatron semantics).

=============  =======================  ==========================
function       forward                  backward
=============  =======================  ==========================
copy_to        identity                 all-reduce (sum)
all_reduce     all-reduce (sum)         identity
all_gather     all-gather along dim     keep this rank's part
scatter        keep this rank's part    all-gather along dim
=============  =======================  ==========================

``shard`` keeps this rank's part of a tensor that needs no gradient (no communication).
A collective that does not complete within the process group's timeout raises an error naming the
rank, the group and the collective (see ``fxshard.runtime.guard``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxshard.runtime.guard import guarded


def _all_reduce(x: torch.Tensor, group, what: str) -> torch.Tensor:
    x = x.contiguous().clone()
    with guarded(what, group):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int, blocks: int, what: str) -> torch.Tensor:
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    with guarded(what, group):
        dist.all_gather(parts, x.contiguous(), group=group)
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    # each rank holds [b0_r, b1_r, ...]; reassemble [b0_0, b0_1, ..., b1_0, ...]
    chunks = [p.chunk(blocks, dim=dim) for p in parts]
    return torch.cat([chunks[r][b] for b in range(blocks) for r in range(world)], dim=dim)


def _take(x: torch.Tensor, dim: int, index: int, parts: int, blocks: int) -> torch.Tensor:
    if blocks == 1:
        return x.chunk(parts, dim=dim)[index].contiguous()
    return torch.cat([b.chunk(parts, dim=dim)[index] for b in x.chunk(blocks, dim=dim)], dim=dim)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "all_reduce (backward of copy_to)"), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "all_reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, blocks):
        ctx.group, ctx.dim, ctx.blocks = group, dim, blocks
        return _all_gather(x, group, dim, blocks, "all_gather")

    @staticmethod
    def backward(ctx, grad):
        index, parts = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return _take(grad, ctx.dim, index, parts, ctx.blocks), None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, index, parts, blocks):
        ctx.group, ctx.dim, ctx.blocks = group, dim, blocks
        return _take(x, dim, index, parts, blocks)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim, ctx.blocks, "all_gather (backward of scatter)"), *([None] * 5)


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return _CopyTo.apply(x, group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results over ``group``; the gradient passes through unchanged."""
    return _AllReduce.apply(x, group)


def all_gather(x: torch.Tensor, group, dim: int, blocks: int = 1) -> torch.Tensor:
    """Concatenate every rank's part along ``dim``; backward keeps this rank's part of the gradient."""
    return _AllGather.apply(x, group, dim, blocks)


def scatter(x: torch.Tensor, group, dim: int, index: int, parts: int, blocks: int = 1) -> torch.Tensor:
    """Keep part ``index`` of ``parts`` along ``dim``; backward all-gathers the gradient."""
    return _Scatter.apply(x, group, dim, index, parts, blocks)


def shard(x: torch.Tensor, dim: int, index: int, parts: int, blocks: int = 1) -> torch.Tensor:
    """Keep part ``index`` of ``parts`` of a tensor that carries no gradient (no communication)."""
    return _take(x, dim, index, parts, blocks)


COLLECTIVES = {"copy_to": copy_to, "all_reduce": all_reduce, "all_gather": all_gather, "scatter": scatter}
