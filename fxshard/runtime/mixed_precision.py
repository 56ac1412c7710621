"""Mixed precision (``--dtype bf16``): bf16 parameters, activations and gradients; fp32 master weights
and Adam state.  Unlike Megatron-LM's default (fp32 ``main_grad`` buffers), gradients are accumulated
and averaged in bf16 at ZeRO 0/1 — the 2Ψ of the ZeRO paper's mixed-precision figures.

ZeRO 0/1 (DDP): the module computes with bf16 parameters and produces bf16 gradients (averaged over
dp in bf16 buckets); :class:`MasterWeightAdamW` keeps an fp32 copy of each parameter, steps AdamW on
it and writes the rounded result back.  At ZeRO 1 each dp rank keeps masters and Adam state only for
its share of the parameters and broadcasts the updated bf16 values: 2Ψ + 2Ψ + 12Ψ/N bytes per rank.

ZeRO 2/3 (FSDP2): the sharded fp32 parameters *are* the master weights; ``MixedPrecisionPolicy``
all-gathers them as bf16 for compute and reduce-scatters gradients in fp32 into fp32 shards, so a
plain AdamW on the shards is the master-weight update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxshard.runtime.guard import guarded


def promote(module: torch.nn.Module) -> None:
    """Give ``module``'s floating parameters fp32 storage (before loading the fp32 weights exactly)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.data = p.data.float()


def split_masters(params: list[torch.nn.Parameter], dtype: torch.dtype) -> list[torch.Tensor]:
    """fp32 master copies of ``params``; the parameters themselves become ``dtype``."""
    masters = []
    with torch.no_grad():
        for p in params:
            masters.append(p.detach().float().clone())
            p.data = p.data.to(dtype)
    return masters


def partition(sizes: list[int], parts: int) -> list[int]:
    """Owner of each tensor: largest first onto the least-loaded part (the same answer on every rank)."""
    load = [0] * parts
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        part = min(range(parts), key=lambda r: (load[r], r))
        owner[i] = part
        load[part] += sizes[i]
    return owner


class MasterWeightAdamW:
    """AdamW on fp32 master weights of low-precision parameters.

    With ``shard_group`` (ZeRO 1), the parameters are partitioned over the group's ranks: each rank
    holds masters and Adam state for its own share only, updates it, and broadcasts the new values.
    """

    def __init__(self, params, masters, config, shard_group=None):
        self.params = list(params)
        self.shard_group = shard_group
        rank, world = (dist.get_rank(shard_group), dist.get_world_size(shard_group)) if shard_group else (0, 1)
        self.owner = partition([p.numel() for p in self.params], world)
        self.owned = [i for i, o in enumerate(self.owner) if o == rank]
        self.masters = {i: masters[i] for i in self.owned}  # the caller must drop its references to the rest
        self.optim = config.make([self.masters[i] for i in self.owned] or [torch.zeros(1, requires_grad=True)])

    def step(self) -> None:
        for i in self.owned:
            g = self.params[i].grad
            self.masters[i].grad = None if g is None else g.detach().float()
        self.optim.step()
        with torch.no_grad():
            for i in self.owned:
                self.masters[i].grad = None
                self.params[i].copy_(self.masters[i])
            if self.shard_group is not None:
                self._broadcast()

    def _broadcast(self) -> None:
        with guarded("broadcast of updated parameters from their ZeRO-1 owner over dp", self.shard_group):
            works = [dist.broadcast(p.data, group_src=self.owner[i], group=self.shard_group, async_op=True)
                     for i, p in enumerate(self.params)]
            for w in works:
                w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything this optimizer holds: masters and Adam moments (for the memory report)."""
        out = list(self.masters.values())
        for st in self.optim.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out


def fsdp_policy(dtype: torch.dtype):
    """FSDP2 mixed precision: gather parameters as ``dtype``, reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
