"""Training settings shared by the distributed run and the single-device reference."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fxshard.defaults import ZERO_BUCKET_MB

if TYPE_CHECKING:  # imported where used: the command line reads these options without loading torch
    import torch


LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    # every field is an option of `fxshard run` (fxshard.train.options), with this "help"
    clip_grad_norm: float | None = field(default=None, metadata={
        "help": "clip the global gradient norm (over all tp, pp and dp shards)"})
    grad_accum: int = field(default=1, metadata={  # one step over them all (see passes/token_mean.py)
        "help": "batches per optimizer step (gradients averaged)"})
    zero_bucket_mb: float = field(default=ZERO_BUCKET_MB, metadata={  # fxshard.runtime.distributed_optimizer's buckets
        "help": "ZeRO 1: MB of parameters per flat bucket (one gradient reduce-scatter and one parameter "
                "all-gather per bucket and step; Megatron-Core's default, 40M fp32 elements)"})
    overlap_param_gather: bool = field(default=True, metadata={  # DistributedOptimizer.gather_before_use
        "help": "ZeRO 1: leave each bucket's parameter all-gather in flight after the step and wait for it just "
                "before the next forward first uses the bucket (Megatron-Core's overlap_param_gather; same values, "
                "same bytes)"})
    weight_decay_all: bool = field(default=False, metadata={  # decayed()
        "help": "apply --weight-decay to every parameter; by default parameters whose source tensor has fewer than "
                "2 dimensions (norms, biases) are spared, as Megatron-Core and nanoGPT do"})
    # the learning rate of each step: fxshard.train.schedule.LRSchedule, under torch's LambdaLR
    lr_schedule: str = field(default="constant", metadata={
        "help": "constant, cosine, linear (to --min-lr over the steps after warmup) or wsd (warmup, stable, then a "
                "linear decay to --min-lr over the last --decay-steps)"})
    warmup_steps: int = field(default=0, metadata={
        "help": "steps whose learning rate rises linearly to --lr: step k (from 0) has lr * (k + 1) / (warmup + 1)"})
    min_lr: float = field(default=0.0, metadata={"help": "the learning rate cosine, linear and wsd decay to"})
    decay_steps: int | None = field(default=None, metadata={
        "help": "wsd: the steps of the final decay (default: the last fifth of --steps)"})

    def __post_init__(self):
        from fxshard.errors import OptionError

        def bad(flag: str, value, expected: str) -> OptionError:
            return OptionError(f"--{flag} {value}: expected {expected}")

        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise bad("lr", self.lr, "a finite learning rate >= 0, e.g. --lr 1e-3")
        for flag, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not (math.isfinite(beta) and 0 <= beta < 1):
                raise bad(flag, beta, "a number in [0, 1), e.g. 0.9 / 0.999")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise bad("eps", self.eps, "a small positive number, e.g. 1e-8")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise bad("weight-decay", self.weight_decay, "a finite number >= 0")
        if self.clip_grad_norm is not None and not (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm > 0):
            raise bad("clip-grad-norm", self.clip_grad_norm, "a positive norm, e.g. 1.0 (leave it out not to clip)")
        if not (isinstance(self.grad_accum, int) and self.grad_accum >= 1):
            raise bad("grad-accum", self.grad_accum, "at least 1 batch per optimizer step")
        if not (math.isfinite(self.zero_bucket_mb) and self.zero_bucket_mb > 0):
            raise bad("zero-bucket-mb", self.zero_bucket_mb, "a positive size in MB, e.g. 160")
        if self.lr_schedule not in LR_SCHEDULES:
            raise bad("lr-schedule", self.lr_schedule, f"one of {', '.join(LR_SCHEDULES)}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise bad("warmup-steps", self.warmup_steps, "a number of steps >= 0")
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise bad("min-lr", self.min_lr, f"a learning rate in [0, --lr {self.lr:g}]")
        if self.decay_steps is not None and not (isinstance(self.decay_steps, int) and self.decay_steps >= 1):
            raise bad("decay-steps", self.decay_steps, "at least 1 step (leave it out for the last fifth of --steps)")
        if self.decay_steps is not None and self.lr_schedule != "wsd":
            raise bad("decay-steps", self.decay_steps, f"--lr-schedule wsd (it is {self.lr_schedule}, which decays "
                      "over every step after warmup)")

    def kwargs(self) -> dict:
        # foreach=True: bitwise equal to the per-tensor loop, sharded or not, and faster (scripts/adamw_variants.py)
        return dict(lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps, weight_decay=self.weight_decay,
                    foreach=True)

    def decayed(self, shape) -> bool:
        """Whether a parameter whose *source* tensor has ``shape`` is in the weight-decayed group: 2 or more
        dimensions (matrices, embeddings, stacked experts), or every parameter with ``weight_decay_all``.  Without
        weight decay every parameter is in the one group, so nothing is split."""
        return self.weight_decay == 0 or self.weight_decay_all or len(shape) >= 2

    def param_groups(self, params, decayed=None) -> list[dict]:
        """AdamW's parameter groups: the decayed parameters, then the spared ones with weight decay 0 (an empty
        group is left out; ``decayed`` None: one group).  Group order and membership do not change any value: AdamW
        is elementwise."""
        params = list(params)
        if decayed is None or all(decayed):
            return [{"params": params}]
        decay = [p for p, d in zip(params, decayed, strict=True) if d]
        spare = [p for p, d in zip(params, decayed, strict=True) if not d]
        return ([{"params": decay}] if decay else []) + [{"params": spare, "weight_decay": 0.0}]

    def make(self, params, decayed=None) -> torch.optim.Optimizer:
        """AdamW over ``params`` (tensors, or torch's group dicts); ``decayed``: one flag per parameter
        (:meth:`decayed`), None: as given, every one decayed."""
        import torch

        return torch.optim.AdamW(params if decayed is None else self.param_groups(params, decayed), **self.kwargs())


def clip_grad_norm_(grads: list[tuple[torch.Tensor, float]], max_norm: float, group=None, device=None) -> float:
    """Clip gradients to a global norm, as ``torch.nn.utils.clip_grad_norm_`` does on one device.

    ``grads`` pairs each local gradient with the weight of its squares in the global sum: 1 for a
    tensor no other rank holds, 1/k for one of k identical copies (replicated over tp, a weight tied
    across k stages, a gradient replicated over dp).  The weighted sums are all-reduced over ``group``
    (all ranks), so every rank computes the same norm and the same scale.  ``device``: where the sum is
    all-reduced when this rank has no gradient (every parameter frozen): NCCL takes no CPU tensor.
    """
    import torch
    import torch.distributed as dist

    from fxshard.runtime.guard import guarded

    device = grads[0][0].device if grads else (device or torch.device("cpu"))
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g, w in grads:
        sq += w * g.detach().to(torch.float64).pow(2).sum()
    if group is not None or dist.is_initialized():
        with guarded("all_reduce of the squared gradient norm (read before every update)", group):
            dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g, _ in grads:
            g.mul_(coef)
    return norm


class ExpertSplitOptimizer:
    """Two optimizers stepped as one: the dense parameters' (ZeRO 1: a distributed optimizer over dp) and the
    experts' (ZeRO 1: one over edp, the ranks that hold the same experts; a dp-wide one would mix one ep rank's
    experts with another's)."""

    def __init__(self, dense, experts):
        self.parts = [dense, experts]
        torch_optims = [o if hasattr(o, "param_groups") else o.optim for o in self.parts]  # MasterWeightAdamW: .optim
        self.param_groups = [g for o in torch_optims for g in o.param_groups]
        self.defaults = torch_optims[0].defaults
        self.state = {}

    def step(self, closure=None):
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def reduce_gradients(self) -> None:
        for o in self.parts:
            o.reduce_gradients()

    def gather_before_use(self, modules, per_submodule: bool = True) -> None:
        for o in self.parts:
            if hasattr(o, "gather_before_use"):  # ZeRO 1's distributed optimizers
                o.gather_before_use(modules, per_submodule)

    def finish_param_sync(self) -> None:
        from fxshard.runtime.distributed_optimizer import finish_param_sync

        for o in self.parts:
            finish_param_sync(o)

    def grad_pieces(self, weights: dict) -> list:
        return [x for o in self.parts for x in o.grad_pieces(weights)]

    def state_tensors(self) -> list:
        from fxshard.train.memory import optimizer_tensors

        return [t for o in self.parts for t in optimizer_tensors(o)]
