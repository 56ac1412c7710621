"""Mixed precision (``--dtype bf16``): bf16 parameters, activations and gradients; fp32 master weights
and Adam state.  Unlike Megatron-LM's default (fp32 ``main_grad`` buffers), gradients are accumulated
and averaged in bf16 at ZeRO 0/1 — the 2Ψ of the ZeRO paper's mixed-precision figures.

ZeRO 0 (DDP): the module computes with bf16 parameters and produces bf16 gradients (averaged over
dp in bf16 buckets); :class:`MasterWeightAdamW` keeps an fp32 copy of each parameter, steps AdamW on
it and writes the rounded result back.  ZeRO 1 (:mod:`fxshard.runtime.distributed_optimizer`): bf16
gradients reduce-scattered in bf16 buckets, each dp rank keeps the fp32 master shard and Adam state of
its 1/N of every bucket and all-gathers the updated bf16 values: 2Ψ + 2Ψ + 12Ψ/N bytes per rank.

ZeRO 2/3 (FSDP2): the sharded fp32 parameters *are* the master weights; ``MixedPrecisionPolicy``
all-gathers them as bf16 for compute and reduce-scatters gradients in fp32 into fp32 shards, so a
plain AdamW on the shards is the master-weight update.
"""

from __future__ import annotations

import torch


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


class MasterWeightAdamW:
    """AdamW on fp32 master weights of low-precision parameters (ZeRO 0, and one device)."""

    def __init__(self, params, masters, config, decayed=None):
        self.params = list(params)
        self.masters = dict(enumerate(masters))
        if not self.masters:
            decayed = None
        self.optim = config.make(list(self.masters.values()) or [torch.zeros(1, requires_grad=True)], decayed)

    @property
    def param_groups(self):
        return self.optim.param_groups

    def step(self) -> None:
        for i, m in self.masters.items():
            g = self.params[i].grad
            m.grad = None if g is None else g.detach().float()
        self.optim.step()
        with torch.no_grad():
            for i, m in self.masters.items():
                m.grad = None
                self.params[i].copy_(m)

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
