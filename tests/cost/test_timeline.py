"""The planned pipeline timeline: torch's schedule order, placed in time; its bubble is the plan's formula."""

from __future__ import annotations

import pytest

from fxshard.cost.costs import bubble_fraction
from fxshard.cost.timeline import Slot, bubble, timeline
from fxshard.ir.context import Layout


def test_1f1b_two_ranks():
    rows = timeline("1f1b", pp=2, microbatches=2, stages_per_rank=1)
    assert rows[0] == [Slot("F", 0, 0, 0, 1), Slot("F", 0, 1, 1, 2), Slot("B", 0, 0, 4, 6), Slot("B", 0, 1, 7, 9)]
    assert rows[1] == [Slot("F", 1, 0, 1, 2), Slot("B", 1, 0, 2, 4), Slot("F", 1, 1, 4, 5), Slot("B", 1, 1, 5, 7)]


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (3, 6)])
def test_bubble_is_the_plans_formula(schedule, v, pp, m):
    rows = timeline(schedule, pp, m, v)
    assert len(rows) == pp
    for rank, slots in rows.items():  # every microbatch's F and B of every stage of the rank, once
        stages = range(rank, pp * v, pp)
        assert sorted((s.action, s.stage, s.microbatch) for s in slots) == sorted(
            (a, st, mb) for a in "FB" for st in stages for mb in range(m))
    expr, _ = bubble_fraction(Layout(pp=pp, schedule=schedule, microbatches=m, virtual_stages=v))
    assert bubble(rows) == pytest.approx(float(expr))


def test_zero_bubble_splits_backward_and_idles_less_than_1f1b():
    rows = timeline("zero-bubble", 2, 4, 1)
    assert {s.action for r in rows.values() for s in r} == {"F", "I", "W"}
    for slots in rows.values():  # W after its own I
        ends = {(s.action, s.stage, s.microbatch): s for s in slots}
        assert all(ends[("W", s.stage, s.microbatch)].start >= s.end for s in slots if s.action == "I")
    assert bubble(rows) < bubble(timeline("1f1b", 2, 4, 1))
