"""How many microbatches a pipeline schedule keeps alive on each stage: forwards done whose backward is not.

Read from torch's own schedule (``torch.distributed.pipelining``, the classes the runtime builds: see
:data:`fxshard.runtime.pipeline.SCHEDULE_CLASSES`), not from a formula: the schedule is built for the
layout with stand-in stages (the order depends only on pp, the microbatches and the stages per rank) and
its ``pipeline_order`` walked action by action.  A microbatch is alive on a stage from its forward ``F``
until its full backward ``B``, or, when the schedule splits the backward (zero-bubble), until the weight
pass ``W``: the input pass ``I`` keeps the graph (``retain_graph``) for ``W``, so nothing is freed before it.

GPipe keeps all ``m``; 1F1B ``p - stage`` (at most ``m``).  torch's 1F1B *describes* its order with one
warm-up forward per later stage even when there are fewer microbatches (its ``_step_microbatches`` runs
``min(m, p - stage)``), so counts are capped at ``m``::

    alive_counts("1f1b", pp=4, microbatches=8, stages_per_rank=1)   # {0: [{0: 4}], 1: [{1: 3}], ...}
"""

from __future__ import annotations

import types
from functools import cache


@cache
def schedule_order(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list]:
    """torch's ``pipeline_order`` (pp rank -> actions, ``None`` for an idle step) of ``schedule``; cached, as the
    search asks for the same orders many times (read it, never change it)."""
    from fxshard.runtime.pipeline import SCHEDULE_CLASSES, make_schedule

    num_stages = pp * stages_per_rank
    if schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"unknown schedule {schedule!r}")
    stages = [_stand_in(s, num_stages, pp) for s in range(0, num_stages, pp)]  # pp rank 0's stages
    return make_schedule(schedule, stages, microbatches, cls=_order_only(SCHEDULE_CLASSES[schedule])).pipeline_order


@cache
def _order_only(cls: type) -> type:
    """``cls`` that computes its ``pipeline_order`` and stops there: the runtime's lowering of that order into
    sends, receives, unshards and reshards (``_prepare_schedule_with_comms``, the last step of the multi-stage
    schedules' constructors, most of their time at 64 stages) is not read here."""
    return type(cls.__name__, (cls,),
                {"_prepare_schedule_with_comms": lambda self, actions, format="compute_only": None})


def _stand_in(index: int, num_stages: int, pp: int):
    """What a schedule's constructor reads of a ``PipelineStage`` (no module, no process group)."""
    return types.SimpleNamespace(stage_index=index, num_stages=num_stages, group_size=pp, group_rank=index % pp,
                                 is_first=index == 0, is_last=index == num_stages - 1, has_backward=True,
                                 submod=None, dw_builder=None)


@cache
def alive_counts(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list[dict[int, int]]]:
    """Per pp rank, the distinct combinations {stage: microbatches alive} its schedule passes through, each
    one not dominated by another (the candidates for the rank's activation peak)."""
    if pp == 1:
        return {0: [{0: 1}]}
    order = schedule_order(schedule, pp, microbatches, stages_per_rank)
    out = {}
    for rank, actions in order.items():
        alive: dict[int, int] = {s: 0 for s in range(rank, pp * stages_per_rank, pp)}
        seen = []
        for a in actions:
            kind = getattr(getattr(a, "computation_type", None), "value", None)
            if kind == "F":
                alive[a.stage_index] = min(alive[a.stage_index] + 1, microbatches)
            elif kind in ("B", "W"):
                alive[a.stage_index] = max(alive[a.stage_index] - 1, 0)
            else:
                continue
            seen.append(dict(alive))
        out[rank] = _maximal(seen) or [dict(alive)]
    return out


def _maximal(vectors: list[dict[int, int]]) -> list[dict[int, int]]:
    """The vectors no other one dominates, in first-seen order.  A vector that dominates another has a larger sum,
    so walking them by decreasing sum, each is checked against the maximal ones kept so far (few) only."""
    unique = [dict(t) for t in dict.fromkeys(tuple(sorted(v.items())) for v in vectors)]
    kept: list[int] = []
    for i in sorted(range(len(unique)), key=lambda i: -sum(unique[i].values())):
        v = unique[i]
        if not any(all(unique[j][k] >= v[k] for k in v) for j in kept):
            kept.append(i)
    return [unique[i] for i in sorted(kept)]
