"""The pipeline schedule as a timeline: per pp rank, when each forward / backward / weight-gradient slot runs.

The order of each rank's actions is torch's own (:func:`fxshard.cost.alive.schedule_order`, the schedule class
the runtime builds); the times are the earliest each action can start in that order, given what it waits for:
``F`` of stage s for ``F`` of stage s-1 (the activation), ``B``/``I`` for the same microbatch's ``B``/``I`` of
stage s+1 (the gradient) and its own ``F``, ``W`` for its ``I``.  A forward takes one unit, a full backward two,
an input or weight pass one each (the cost model's 3 x forward for a step).  Idle units are the bubble.

Microbatches are numbered in the order each stage runs them: torch's single-stage schedules *describe* the
later ranks' 1F1B order with warm-up indices shifted by one (``1F1 1B0 1F2 ...`` for ``F0 B0 F1 B1 ...``),
while every schedule runs each stage's forwards, and its backwards, in microbatch order::

    timeline("1f1b", pp=2, microbatches=2, stages_per_rank=1)[1]
    # [Slot('F', 1, 0, 1, 2), Slot('B', 1, 0, 2, 4), Slot('F', 1, 1, 4, 5), Slot('B', 1, 1, 5, 7)]
"""

from __future__ import annotations

from dataclasses import dataclass

DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}


@dataclass(frozen=True)
class Slot:
    action: str  # F, B (full backward), I (input gradient), W (weight gradient)
    stage: int
    microbatch: int
    start: int
    end: int

    def to_json(self) -> dict:
        return {"action": self.action, "stage": self.stage, "microbatch": self.microbatch, "start": self.start,
                "end": self.end}


def action_order(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list[tuple]]:
    """Per pp rank, its (action, stage, microbatch) in the order torch's schedule runs them."""
    from fxshard.cost.alive import schedule_order

    if pp == 1:
        return {0: [("F", s, m) for s in range(stages_per_rank) for m in range(microbatches)]
                + [("B", s, m) for s in reversed(range(stages_per_rank)) for m in range(microbatches)]}
    out = {}
    for rank, actions in schedule_order(schedule, pp, microbatches, stages_per_rank).items():
        seen: dict[tuple[str, int], int] = {}
        order = []
        for a in actions:
            kind = getattr(getattr(a, "computation_type", None), "value", None)
            if kind not in DURATION:
                continue  # idle (None) or bookkeeping (REDUCE_GRAD)
            number = seen.get((kind, a.stage_index), 0)
            if number < microbatches:
                order.append((kind, a.stage_index, number))
            seen[(kind, a.stage_index)] = number + 1
        out[rank] = order
    return out


def timeline(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list[Slot]]:
    """Per pp rank, its slots with start and end in units of one forward (see the module docstring)."""
    orders = action_order(schedule, pp, microbatches, stages_per_rank)
    last_stage = pp * stages_per_rank - 1
    done: dict[tuple[str, int, int], int] = {}
    free = dict.fromkeys(orders, 0)
    cursor = dict.fromkeys(orders, 0)
    slots: dict[int, list[Slot]] = {r: [] for r in orders}
    while any(cursor[r] < len(orders[r]) for r in orders):
        progressed = False
        for rank, order in orders.items():
            while cursor[rank] < len(order):
                kind, stage, mb = order[cursor[rank]]
                needs = _needs(kind, stage, mb, last_stage)
                if any(n not in done for n in needs):
                    break
                start = max([free[rank]] + [done[n] for n in needs])
                end = start + DURATION[kind]
                done[("I" if kind == "B" else kind, stage, mb)] = end  # a full backward also gives the input grad
                done[(kind, stage, mb)] = end
                slots[rank].append(Slot(kind, stage, mb, start, end))
                free[rank], cursor[rank], progressed = end, cursor[rank] + 1, True
        if not progressed:
            raise ValueError(f"schedule {schedule}: the actions of pp={pp}, {microbatches} microbatches wait on each "
                             "other (no rank can go on)")
    return slots


def _needs(kind: str, stage: int, mb: int, last_stage: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "W":
        return [("I", stage, mb)]
    return [("F", stage, mb)] + ([("I", stage + 1, mb)] if stage < last_stage else [])


def bubble(slots: dict[int, list[Slot]]) -> float:
    """The idle share of the ranks' time from the first slot to the last (the timeline's bubble fraction)."""
    span = max((s.end for row in slots.values() for s in row), default=0)
    if not span:
        return 0.0
    busy = sum(s.end - s.start for row in slots.values() for s in row)
    return 1 - busy / (span * len(slots))
