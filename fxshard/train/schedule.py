"""Learning-rate schedules: ``--lr-schedule constant|cosine|linear|wsd`` with ``--warmup-steps``, ``--min-lr`` and
``--decay-steps``, run by torch's own ``LambdaLR``.

:class:`LRSchedule` is the factor of ``--lr`` at each optimizer step ``s`` (counted from 0, LambdaLR's
``last_epoch``), with ``W`` warmup steps, ``T`` = ``--steps`` and ``f`` = ``min_lr / lr``::

    warmup (s < W)           (s + 1) / (W + 1)                        torchtitan's warmup: step 0 already trains
    constant                 1
    linear                   f + (1 - f) * (1 - p)                    p = (s - W) / (T - W)
    cosine                   f + (1 - f) * (1 + cos(pi * p)) / 2
    wsd                      1 until step T - D, then f + (1 - f) * (1 - q),   q = (s - (T - D)) / D

``D`` is ``--decay-steps`` (default: ``T // 5``).  Being an object, not a lambda, LambdaLR's ``state_dict``
carries the schedule itself, so a checkpoint restores both where the schedule is and what it is.  The same
class drives the single-device reference (:mod:`fxshard.train.reference`), so verify stays exact::

    scheduler = make_scheduler(program.optimizer, OptimConfig(lr=3e-4, lr_schedule="cosine", warmup_steps=100),
                               steps=10_000)
    ...; program.optimizer.step(); scheduler.step()
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class LRSchedule:
    """LambdaLR's ``lr_lambda``: the factor of the base learning rate at optimizer step ``s`` (from 0)."""

    kind: str = "constant"
    warmup: int = 0
    total: int = 1  # --steps
    decay: int = 0  # wsd: the steps of the final decay
    floor: float = 0.0  # min_lr / lr

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return 1.0
        if self.kind == "wsd":
            start = self.total - self.decay
            if s < start:
                return 1.0
            left = 1.0 - min(1.0, (s - start) / max(1, self.decay))
        else:
            span = self.total - self.warmup
            p = min(1.0, (s - self.warmup) / span) if span > 0 else 1.0
            left = 0.5 * (1.0 + math.cos(math.pi * p)) if self.kind == "cosine" else 1.0 - p
        return self.floor + (1.0 - self.floor) * left

    def describe(self) -> str:
        if self.kind == "constant" and not self.warmup:
            return "constant"
        parts = [self.kind] + ([f"{self.warmup} warmup steps"] if self.warmup else [])
        if self.kind == "wsd":
            parts.append(f"decay over the last {self.decay} of {self.total} steps")
        if self.kind != "constant":
            parts.append(f"to {self.floor:g} x lr")
        return ", ".join(parts)


def lr_schedule(optim, steps: int) -> LRSchedule:
    """The schedule ``optim`` (an :class:`~fxshard.train.optim.OptimConfig`) asks for over ``steps`` steps."""
    decay = optim.decay_steps if optim.decay_steps is not None else max(1, steps // 5)
    floor = optim.min_lr / optim.lr if optim.lr > 0 else 0.0
    return LRSchedule(optim.lr_schedule, optim.warmup_steps, steps, decay if optim.lr_schedule == "wsd" else 0, floor)


def make_scheduler(optimizer, optim, steps: int):
    """torch's ``LambdaLR`` over ``optimizer`` with the schedule of ``optim`` for a run of ``steps`` steps; it sets
    the first step's learning rate on construction.  Call its ``step()`` after each ``optimizer.step()``."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lr_schedule(optim, steps))


def check_schedule(optim, steps: int) -> None:
    """Refuse a schedule that does not fit ``--steps`` (a warmup or a decay as long as the run)."""
    from fxshard.errors import OptionError

    if optim.warmup_steps and optim.warmup_steps >= steps:
        raise OptionError(f"--warmup-steps {optim.warmup_steps}: the run has {steps} steps; the warmup must end "
                          f"before the last step (at most {steps - 1}), or pass more --steps")
    if optim.lr_schedule == "wsd" and optim.decay_steps is not None and \
            optim.warmup_steps + optim.decay_steps > steps:
        raise OptionError(f"--decay-steps {optim.decay_steps}: with --warmup-steps {optim.warmup_steps} it leaves no "
                          f"room in {steps} steps; use at most {max(1, steps - optim.warmup_steps)}")


def schedule_record(schedule: LRSchedule) -> dict:
    return asdict(schedule)
