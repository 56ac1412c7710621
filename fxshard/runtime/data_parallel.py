"""Data parallelism and ZeRO over the ``dp`` axis, with torch's own machinery.

======  ==============================================  ===========================================
zero    gradients                                       parameters / optimizer state
======  ==============================================  ===========================================
0       DDP: bucketed all-reduce (average), overlapping  replicated / replicated
        backward
1       DDP, as above                                    replicated / sharded over dp
                                                         (``ZeroRedundancyOptimizer``)
2       FSDP2 ``fully_shard``: reduce-scatter (average)  kept gathered after forward (not resharded);
        as backward produces them, each rank keeps its   optimizer state of the rank's shard only
        shard
3       FSDP2 ``fully_shard``, as above                  sharded: all-gathered before forward and
                                                         backward, freed after; state of the shard
======  ==============================================  ===========================================

The generated tensor-parallel code holds plain local tensors, so DDP and FSDP2 see an ordinary
module and shard or replicate its (already tp-sliced) parameters over dp.  ``torch.distributed
.pipelining`` knows both wrappers (no gradient sync per microbatch, one at the end of the step).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard as _fully_shard
from torch.nn.parallel import DistributedDataParallel

DDP_BUCKET_MB = 25


def ddp(module: torch.nn.Module, dp_mesh) -> torch.nn.Module:
    """Replicate ``module`` over dp; gradients are averaged in buckets while backward runs."""
    return DistributedDataParallel(module, process_group=dp_mesh.get_group(), bucket_cap_mb=DDP_BUCKET_MB,
                                   broadcast_buffers=False, find_unused_parameters=False)


def fully_shard(module: torch.nn.Module, dp_mesh, reshard_after_forward: bool) -> torch.nn.Module:
    """Shard ``module``'s parameters, gradients and optimizer state over dp (FSDP2)."""
    return _fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def inner(module: torch.nn.Module) -> torch.nn.Module:
    """The generated module inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def make_optimizer(params, config, zero: int, dp_group):
    """AdamW over ``params``; at ZeRO stage 1 its state is sharded over dp (each parameter's on one rank)."""
    if zero == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=dp_group,
                                       **config.kwargs())
    return config.make(params)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2's sharded parameters and gradients), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t
