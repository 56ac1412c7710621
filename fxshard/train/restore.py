"""A checkpoint's tensors given to a rank of any layout: each parameter's trained value and its AdamW state, in place,
wherever the layout keeps them (the parameter itself under DDP, a DTensor's dp shard under FSDP2, the fp32 master
and the rounded parameter under mixed precision, this rank's part of ZeRO 1's buckets, the experts' own optimizer
under --ep), so a resumed run and an uninterrupted one hold the same values bit for bit::

    load_trained(CheckpointReader("ckpt"), opt, held, entry, dp_group)
"""

from __future__ import annotations

import torch

from fxshard.codegen.manifest import RankEntry
from fxshard.train.checkpoint import STATE_KINDS, CheckpointError, CheckpointReader, _optimizers


def load_trained(reader: CheckpointReader, opt, held: dict, entry: RankEntry, dp_group, edp_group=None) -> None:
    """Give this rank's parameters, in place, and its optimizer the checkpoint's trained values and Adam state, each
    where the layout keeps it: the parameter itself (DDP), its dp shard (FSDP2, a DTensor), the fp32 master and the
    rounded parameter (mixed precision), this rank's part of its ZeRO-1 buckets; under --ep the experts' optimizer
    gets this ep rank's slice of theirs (at ZeRO 1 the share of this rank of edp).  The set-up is the one the run
    trains with, so a resumed run and an uninterrupted one hold the same values bit for bit."""
    parts = _optimizers(opt, dp_group, edp_group)
    with torch.no_grad():
        for prefix, module in held.items():
            for name, p in module.named_parameters():
                t = entry.tensors[prefix + name]
                if t.source in reader.frozen:  # a LoRA base, left out of the save: it keeps the compile's value
                    continue
                value = reader.tensor(t.source, "param", t.slice)
                if tuple(value.shape) != tuple(p.shape):
                    raise CheckpointError(f"{reader.path}: tensor {t.source} gives this rank shape "
                                          f"{tuple(value.shape)}, the rank module expects {tuple(p.shape)}")
                owner, group = parts[t.axis]
                _give_value(owner, p, value)
                if p.requires_grad and reader.has_state(t.source):  # frozen: no optimizer state to give
                    _give_state(owner, group, p, {k: reader.tensor(t.source, k, t.slice) for k in STATE_KINDS})


def _give_value(opt, p, value: torch.Tensor) -> None:
    """Make ``value`` (fp32, p's tp slice) ``p``'s trained value wherever ``opt`` and the layout keep it."""
    from fxshard.runtime.distributed_optimizer import DistributedOptimizer
    from fxshard.runtime.mixed_precision import MasterWeightAdamW

    if not p.requires_grad and not hasattr(p, "to_local"):  # frozen: no optimizer holds it
        p.copy_(value)
    elif isinstance(opt, DistributedOptimizer):
        opt.load_value(p, value)  # the bucket's view, and this rank's part of the fp32 master shard
    elif hasattr(p, "to_local"):  # FSDP2: this dp rank's shard (fp32 under mixed precision: the master)
        from torch.distributed.tensor import distribute_tensor

        local = p.to_local()
        mine = distribute_tensor(value.to(local.device, local.dtype), p.device_mesh, p.placements, src_data_rank=None)
        local.copy_(mine.to_local())
    else:
        if isinstance(opt, MasterWeightAdamW):
            i = next(i for i, q in enumerate(opt.params) if q is p)
            if i in opt.masters:
                opt.masters[i].copy_(value)
        p.copy_(value)  # rounded to the compute dtype under mixed precision, as split_masters rounds


def _give_state(opt, group, p, state: dict) -> None:
    """Make ``state`` ``p``'s Adam state in ``opt`` where ``opt`` keeps it (ZeRO 1: this rank's part of its buckets)."""
    from fxshard.runtime.distributed_optimizer import DistributedOptimizer
    from fxshard.runtime.mixed_precision import MasterWeightAdamW

    if isinstance(opt, MasterWeightAdamW):
        m = opt.masters.get(next(i for i, q in enumerate(opt.params) if q is p))
        if m is not None:
            opt.optim.state[m] = _on(state, m)
    elif isinstance(opt, DistributedOptimizer):
        opt.load_state(p, state)  # this rank's part of each of its buckets (ZeRO 1)
    else:
        opt.state[p] = _on(state, p)


def _on(state: dict, p) -> dict:
    """Adam state shaped like ``p``: moved to its device, or its dp shard when ``p`` is a DTensor (FSDP2)."""
    out = {"step": state["step"].float().cpu()}
    for k in ("exp_avg", "exp_avg_sq"):
        v = state[k].to(p.dtype if not hasattr(p, "to_local") else p.to_local().dtype)
        if hasattr(p, "to_local"):
            from torch.distributed.tensor import distribute_tensor

            v = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            assert v.to_local().shape == p.to_local().shape, (k, v.to_local().shape, p.to_local().shape)
        else:
            v = v.to(p.device).clone()
        out[k] = v
    return out
