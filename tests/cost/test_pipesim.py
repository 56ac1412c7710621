"""The pipeline step from torch's schedule actions: even stages give the closed formulas, uneven stages and
transfers come out as the order runs them, and the extrapolation for long schedules agrees with simulation."""

from __future__ import annotations

import random

import pytest

from fxshard.cost import pipesim
from fxshard.cost.alive import alive_counts
from fxshard.cost.pipesim import pipeline_step, schedule_order, simulate


def _unit(a):
    return 1.0


def _free(a, forward):
    return 0.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (3, 7)])
def test_even_stages_take_m_plus_p_minus_1_rounds(schedule, pp, m):
    ends, busy = simulate(schedule_order(schedule, pp, m, 1), _unit, _free)
    assert max(ends.values()) == pytest.approx((m + pp - 1) * 2)
    assert all(b == pytest.approx(2 * m) for b in busy.values())


def test_interleaving_and_zero_bubble_idle_less_than_1f1b():
    plain = max(simulate(schedule_order("1f1b", 4, 8, 1), lambda a: 2.0, _free)[0].values())
    # two virtual stages per rank, each half the work: the same compute per rank
    interleaved = max(simulate(schedule_order("interleaved-1f1b", 4, 8, 2), _unit, _free)[0].values())
    assert interleaved < plain

    def split(a):  # zero-bubble: backward as input (I) and weight (W) halves
        return {"F": 1.0, "I": 0.5, "W": 0.5, "B": 1.0}[pipesim._kind(a)]

    zb = max(simulate(schedule_order("zero-bubble", 4, 8, 1), split, _free)[0].values())
    assert zb < max(simulate(schedule_order("1f1b", 4, 8, 1), _unit, _free)[0].values())


def test_a_slow_stage_sets_the_pace_and_transfers_add_to_the_critical_path():
    pp, m = 4, 8

    def slow_last(a):
        return 3.0 if a.stage_index == pp - 1 else 1.0

    ends, busy = simulate(schedule_order("1f1b", pp, m, 1), slow_last, _free)
    assert max(ends.values()) >= m * 6.0  # the last stage's own work, F + B = 6 per microbatch
    assert busy[pp - 1] == pytest.approx(6.0 * m)
    base = max(simulate(schedule_order("1f1b", pp, m, 1), _unit, _free)[0].values())
    sent = max(simulate(schedule_order("1f1b", pp, m, 1), _unit, lambda a, fwd: 0.25)[0].values())
    # warm-up forwards and the first backward's return each cross pp - 1 links
    assert sent >= base + 2 * (pp - 1) * 0.25


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 1)])
def test_long_schedules_extrapolate_to_what_simulation_gives(schedule, v, monkeypatch):
    pp, m = 2, 24

    def uneven(a):
        return 1.0 + 0.5 * a.stage_index

    direct = pipeline_step(schedule, pp, m, v, uneven, lambda a, fwd: 0.1)[0]
    monkeypatch.setattr(pipesim, "DIRECT_ACTIONS", 8)  # force the two-point extrapolation
    extrapolated = pipeline_step(schedule, pp, m, v, uneven, lambda a, fwd: 0.1)[0]
    assert max(extrapolated.values()) == pytest.approx(max(direct.values()), rel=1e-9)


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2),
                                              ("interleaved-1f1b", 2, 6, 3), ("zero-bubble", 4, 8, 2)])
def test_the_order_read_is_torchs_own_without_its_lowering(schedule, pp, m, v):
    """The cost model builds torch's schedule without lowering its order to sends and receives (most of the time at 64
    stages): the compute order is the one the runtime's schedule holds."""
    from fxshard.cost.alive import _stand_in
    from fxshard.runtime.pipeline import make_schedule

    stages = [_stand_in(s, pp * v, pp) for s in range(0, pp * v, pp)]
    full = make_schedule(schedule, stages, m).pipeline_order
    assert {r: [str(a) for a in acts] for r, acts in schedule_order(schedule, pp, m, v).items()} == \
        {r: [str(a) for a in acts] for r, acts in full.items()}


def test_the_microbatches_alive_are_the_maximal_combinations():
    from fxshard.cost.alive import _maximal

    seen = [{0: 1, 4: 0}, {0: 2, 4: 0}, {0: 2, 4: 1}, {0: 1, 4: 2}, {0: 0, 4: 2}, {0: 2, 4: 1}, {0: 1, 4: 1}]
    assert _maximal(seen) == [{0: 2, 4: 1}, {0: 1, 4: 2}]
    rng = random.Random(0)
    for _ in range(20):  # the same as comparing every pair
        seen = [{s: rng.randrange(4) for s in (0, 4, 8)} for _ in range(30)]
        unique = [dict(t) for t in dict.fromkeys(tuple(sorted(v.items())) for v in seen)]
        pairs = [v for v in unique if not any(w != v and all(w[k] >= v[k] for k in v) for w in unique)]
        assert _maximal(seen) == pairs
    assert alive_counts("1f1b", 4, 8, 1)[0] == [{0: 4}] and alive_counts("gpipe", 2, 6, 1)[1] == [{1: 6}]
