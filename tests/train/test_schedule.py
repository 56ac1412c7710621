"""Learning-rate schedules and weight-decay groups, in one process: each ``--lr-schedule`` is torch's LambdaLR of the
formula docs/training.md states, to the bit; a schedule survives a checkpoint's JSON; 1-D parameters are spared."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from fxshard.errors import OptionError
from fxshard.train.optim import OptimConfig
from fxshard.train.schedule import check_schedule, make_scheduler

STEPS, WARMUP, LR, MIN_LR, DECAY = 20, 3, 1e-3, 1e-4, 5


def _documented(kind: str):
    """The formulas of docs/training.md, written out again here (s: optimizer steps taken, from 0)."""
    f = MIN_LR / LR

    def factor(s: int) -> float:
        if s < WARMUP:
            return (s + 1) / (WARMUP + 1)
        if kind == "constant":
            return 1.0
        if kind == "wsd":
            if s < STEPS - DECAY:
                return 1.0
            return f + (1 - f) * (1 - min(1.0, (s - (STEPS - DECAY)) / DECAY))
        p = min(1.0, (s - WARMUP) / (STEPS - WARMUP))
        return f + (1 - f) * (0.5 * (1 + math.cos(math.pi * p)) if kind == "cosine" else 1 - p)

    return factor


def _lrs(scheduler, steps: int = STEPS) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=LR)


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear", "wsd"])
def test_each_schedule_is_lambdalr_of_its_formula_to_the_bit(kind):
    optim = OptimConfig(lr=LR, lr_schedule=kind, warmup_steps=WARMUP, min_lr=MIN_LR,
                        decay_steps=DECAY if kind == "wsd" else None)
    got = _lrs(make_scheduler(_sgd(), optim, STEPS))
    want = _lrs(LambdaLR(_sgd(), _documented(kind)))
    assert got == want  # bit for bit, every step
    assert got[0] == LR / (WARMUP + 1) and got[WARMUP] == LR
    if kind == "wsd":
        assert got[STEPS - DECAY - 1] == LR and got[-1] < LR
    if kind in ("cosine", "linear"):
        assert MIN_LR < got[-1] < got[WARMUP + 1]


def test_a_schedule_continues_from_its_json_state_with_another_group_count():
    """A checkpoint keeps LambdaLR's state as JSON, the schedule itself included; restored over a fresh scheduler of
    default options and of another number of parameter groups (another layout's rank), it goes on as the original."""
    from fxshard.train.program import _restore_scheduler

    optim = OptimConfig(lr=LR, lr_schedule="cosine", warmup_steps=WARMUP, min_lr=MIN_LR)
    original = make_scheduler(_sgd(), optim, STEPS)
    _lrs(original, 7)
    state = json.loads(json.dumps(original.state_dict()))
    two_groups = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))], "weight_decay": 0.0}], lr=LR)
    resumed = make_scheduler(two_groups, OptimConfig(lr=LR), STEPS)  # constant, unless restored
    _restore_scheduler(resumed, state, 7)
    assert [g["lr"] for g in two_groups.param_groups] == [original.optimizer.param_groups[0]["lr"]] * 2
    assert _lrs(resumed, STEPS - 7) == _lrs(original, STEPS - 7)


def test_weight_decay_spares_parameters_of_fewer_than_two_dimensions():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    params = list(model.parameters())
    decayed = [OptimConfig(weight_decay=0.1).decayed(p.shape) for p in params]
    assert decayed == [True, False, False, False]  # weight; bias, norm weight, norm bias
    groups = OptimConfig(weight_decay=0.1).make(params, decayed).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(1, 0.1), (3, 0.0)]
    assert len(OptimConfig(weight_decay=0.1, weight_decay_all=True).make(
        params, [OptimConfig(weight_decay_all=True).decayed(p.shape) for p in params]).param_groups) == 1
    assert all(OptimConfig().decayed(p.shape) for p in params)  # no weight decay: one group, nothing split


@pytest.mark.parametrize(("make", "says"), [
    (lambda: OptimConfig(lr_schedule="exponential"), "--lr-schedule exponential: expected one of constant"),
    (lambda: OptimConfig(lr=1e-3, min_lr=1e-2), "--min-lr 0.01: expected a learning rate in [0, --lr 0.001]"),
    (lambda: OptimConfig(lr_schedule="cosine", decay_steps=5), "--decay-steps 5: expected --lr-schedule wsd"),
    (lambda: check_schedule(OptimConfig(warmup_steps=10), 10), "--warmup-steps 10: the run has 10 steps"),
    (lambda: check_schedule(OptimConfig(lr_schedule="wsd", warmup_steps=4, decay_steps=8), 10), "--decay-steps 8"),
])
def test_a_schedule_that_cannot_run_is_refused(make, says):
    with pytest.raises(OptionError, match=None) as e:
        make()
    assert says in str(e.value)
