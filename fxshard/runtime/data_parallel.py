"""Data parallelism and ZeRO over the ``dp`` axis, with torch's own machinery.

======  ==============================================  ===========================================
zero    gradients                                       parameters / optimizer state
======  ==============================================  ===========================================
0       DDP: bucketed all-reduce (average), overlapping  replicated / replicated
        backward
1       reduce-scatter (average) once per step, one per  replicated (all-gathered per bucket after the
        flat bucket, into each rank's shard (no DDP)     step) / sharded over dp
                                                         (:mod:`~fxshard.runtime.distributed_optimizer`)
2       FSDP2 ``fully_shard``: reduce-scatter (average)  kept gathered after forward (not resharded);
        as backward produces them, each rank keeps its   optimizer state of the rank's shard only
        shard
3       FSDP2 ``fully_shard``, as above, one unit per   sharded: all-gathered before forward and
        repeated block and one for the rest             backward, freed after (per block); state of
                                                         the shard
======  ==============================================  ===========================================

The generated tensor-parallel code holds plain local tensors, so DDP and FSDP2 see an ordinary
module and shard or replicate its (already tp-sliced) parameters over dp.  ``torch.distributed
.pipelining`` knows both wrappers (no gradient sync per microbatch, one at the end of the step).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.fsdp import fully_shard as _fully_shard
from torch.nn.parallel import DistributedDataParallel

DDP_BUCKET_MB = 25


def ddp(module: torch.nn.Module, dp_mesh, ignore: list[str] = ()) -> torch.nn.Module:
    """Replicate ``module`` over dp; gradients are averaged in buckets while backward runs.

    The gradients are views into DDP's buckets (``gradient_as_bucket_view``), so they are held once,
    not once in ``.grad`` and again in the bucket.  ``ignore``: parameters (by name) DDP leaves alone, the
    experts of an expert-parallel layer, which differ between the dp ranks (:mod:`fxshard.runtime.experts`)."""
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
    with warnings.catch_warnings():  # broadcast_buffers=False is what we mean: no buffer sync at all
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(module, process_group=dp_mesh.get_group(), bucket_cap_mb=DDP_BUCKET_MB,
                                       broadcast_buffers=False, find_unused_parameters=False,
                                       gradient_as_bucket_view=True)


def fully_shard(module: torch.nn.Module, dp_mesh, reshard_after_forward: bool,
                param_dtype: torch.dtype | None = None, blocks=(), ignore: list[str] = ()) -> torch.nn.Module:
    """Shard ``module``'s parameters, gradients and optimizer state over dp (FSDP2).

    ``blocks``: submodules of ``module`` (its repeated blocks, in the order they run) that become FSDP2
    units of their own: each block's parameters are gathered just before it runs and freed after it
    (forward, and again in backward), the next block's gather issued while this one computes, so a rank
    holds its shards plus about two blocks instead of the whole module.  With ``param_dtype`` (mixed
    precision), the fp32 shards are the master weights; parameters are gathered as ``param_dtype`` and
    gradients reduced in fp32.  ``ignore``: parameters (by name) FSDP2 leaves whole and alone, the experts of an
    expert-parallel layer, which differ between the dp ranks (:mod:`fxshard.runtime.experts`)."""
    from fxshard.runtime.mixed_precision import fsdp_policy

    policy = {"mp_policy": fsdp_policy(param_dtype)} if param_dtype is not None else {}
    if ignore:
        policy["ignored_params"] = {p for name, p in module.named_parameters() if name in set(ignore)}
    units = [_fully_shard(b, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **policy) for b in blocks]
    for block, after in zip(units, units[1:], strict=False):
        block.set_modules_to_forward_prefetch([after])
    return _fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **policy)


def inner(module: torch.nn.Module) -> torch.nn.Module:
    """The generated module inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def make_optimizer(params, config, zero: int, dp_group, masters=None, names=None, average_over=None, decayed=None):
    """AdamW over ``params``; at ZeRO stage 1 fxshard's distributed optimizer, its state sharded over ``dp_group``
    in flat buckets of ``config.zero_bucket_mb``; ``names`` and ``average_over``: see
    :class:`~fxshard.runtime.distributed_optimizer.DistributedOptimizer`.  ``decayed``: one flag per parameter,
    whether weight decay applies to it (``config.param_groups``).

    With ``masters`` (fp32 copies of low-precision ``params``), AdamW steps the masters instead."""
    if zero == 1:
        from fxshard.runtime.distributed_optimizer import DistributedOptimizer

        return DistributedOptimizer(params, config, dp_group, masters, average_over=average_over, names=names,
                                    decayed=decayed)
    if masters is not None:
        from fxshard.runtime.mixed_precision import MasterWeightAdamW

        return MasterWeightAdamW(params, masters, config, decayed)
    if not params:  # a rank with nothing to train (a pipeline stage holding no experts under --ep, or only frozen ones)
        return config.make([torch.zeros(1, requires_grad=True)])
    return config.make(params, decayed)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2's sharded parameters and gradients), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t
