"""A pipeline step from its schedule's actions: torch's own order, each action timed, run until all are done.

:func:`fxshard.cost.alive.schedule_order` gives, per pp rank, the actions torch's schedule runs (``0F3``: stage 0
forward of microbatch 3; ``B`` a full backward, ``I`` / ``W`` the input and weight halves of a split one).  Each
rank runs its actions in that order; an action starts when its rank is free and what it needs is there: a forward
the previous stage's forward of the same microbatch (plus the send between them), a backward the next stage's
backward (or, on the last stage, its own forward), a weight pass its input pass.  The step is when the last rank
finishes; no closed formula (``(p-1)/(m+p-1)``) is assumed, so uneven stages, interleaving and split backwards
come out as torch runs them::

    ends, busy = simulate(schedule_order("1f1b", 4, 8, 1), lambda a: 1.0, lambda a, fwd: 0.0)
    max(ends.values())     # 22.0: (m + p - 1) * (F + B) with F = B = 1
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fxshard.cost.alive import schedule_order

# beyond this many actions per rank the order is not built: the step is extrapolated from two smaller counts
DIRECT_ACTIONS = 1024


def _kind(action) -> str | None:
    if isinstance(action, _Step):
        return action.kind
    return getattr(getattr(action, "computation_type", None), "value", None)


def simulate(order: dict[int, list], duration: Callable, transfer: Callable, start: dict[int, float] | None = None
             ) -> tuple[dict[int, float], dict[int, float]]:
    """(end, busy) per rank: when each finishes its actions and how long it computed.  ``duration(action)``;
    ``transfer(action, forward)``: the send that delivers what ``action`` needs from the neighbouring stage."""
    actions = _numbered(order)
    num_stages = 1 + max((a.stage_index for acts in actions.values() for a in acts), default=0)
    done: dict[tuple, float] = {}
    clock = {r: (start or {}).get(r, 0.0) for r in actions}
    busy = dict.fromkeys(actions, 0.0)
    ptr = dict.fromkeys(actions, 0)
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for r, acts in actions.items():
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                ready = _ready(a, done, num_stages, transfer)
                if ready is None:
                    break
                begin = max(clock[r], ready)
                took = duration(a)
                clock[r] = begin + took
                busy[r] += took
                done[(_kind(a), a.stage_index, a.microbatch_index)] = clock[r]
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocks in simulation: " +
                               ", ".join(f"rank {r} waits at {acts[ptr[r]]}" for r, acts in actions.items()
                                         if ptr[r] < len(acts)))
    return clock, busy


@dataclass(frozen=True)
class _Step:
    stage_index: int
    microbatch_index: int
    kind: str


def _numbered(order: dict[int, list]) -> dict[int, list[_Step]]:
    """Each rank's compute actions, the k-th of a kind on a stage numbered microbatch k: every schedule runs a stage's
    microbatches in order, and torch 2.13's ``Schedule1F1B.pipeline_order`` numbers the last rank's forwards from 1
    (it runs them from 0)."""
    seen: dict[tuple[str, int], int] = {}
    out = {}
    for r, acts in order.items():
        steps = []
        for a in acts:
            kind = _kind(a)
            if kind not in ("F", "B", "I", "W"):
                continue
            k = seen.get((kind, a.stage_index), 0)
            seen[(kind, a.stage_index)] = k + 1
            steps.append(_Step(a.stage_index, k, kind))
        out[r] = steps
    return out


def _ready(a, done: dict, num_stages: int, transfer) -> float | None:
    """When what action ``a`` needs is there, or None if it is not done yet."""
    kind, s, i = _kind(a), a.stage_index, a.microbatch_index
    if kind == "F":
        if s == 0:
            return 0.0
        t = done.get(("F", s - 1, i))
        return None if t is None else t + transfer(a, True)
    if kind == "W":
        return done.get(("I", s, i))
    own = done.get(("F", s, i))
    if own is None:
        return None
    if s == num_stages - 1:
        return own
    nxt = done.get(("B", s + 1, i), done.get(("I", s + 1, i)))
    return None if nxt is None else max(own, nxt + transfer(a, False))


def pipeline_step(schedule: str, pp: int, microbatches: int, stages_per_rank: int, duration: Callable,
                  transfer: Callable,
                  start: dict[int, float] | None = None) -> tuple[dict[int, float], dict[int, float]]:
    """(end, busy) per pp rank for ``microbatches``: simulated on torch's order, or, when the order would exceed
    :data:`DIRECT_ACTIONS` actions per rank, extrapolated linearly from two simulated counts (k and k+1 rounds of
    pp microbatches: past the warm-up every schedule repeats one pattern per round)."""
    per_rank = 2 * microbatches * stages_per_rank + microbatches * stages_per_rank * (schedule == "zero-bubble")
    if per_rank <= DIRECT_ACTIONS or microbatches <= 3 * pp:
        return simulate(schedule_order(schedule, pp, microbatches, stages_per_rank), duration, transfer, start)
    m1, m2 = 2 * pp, 3 * pp
    e1, b1 = simulate(schedule_order(schedule, pp, m1, stages_per_rank), duration, transfer, start)
    e2, b2 = simulate(schedule_order(schedule, pp, m2, stages_per_rank), duration, transfer, start)
    k = (microbatches - m1) / (m2 - m1)
    return ({r: e1[r] + k * (e2[r] - e1[r]) for r in e1}, {r: b1[r] + k * (b2[r] - b1[r]) for r in b1})


def capped_microbatches(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> int:
    """The microbatch count whose torch order gives the same microbatches alive as ``microbatches`` (GPipe keeps
    all m; the other schedules stop growing after their warm-up), small enough to build quickly."""
    if schedule == "gpipe" or microbatches <= 3 * pp:
        return microbatches
    return 3 * pp
