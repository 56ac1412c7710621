"""State shared by the passes: the layout, the captured program, the plan, and what the passes learn.

Pass-to-pass facts about a node live under one key, ``node.meta["fxshard"]``, as a frozen
:class:`~fxshard.ir.spec.NodeSpec`.  Everything else a pass learns goes into the :class:`CompileContext`.
The passes import the names they share from here: the layout's (:mod:`fxshard.ir.layout`) and the node facts'
(:mod:`fxshard.ir.spec`) as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fxshard.capture.program import Program
from fxshard.ir.cut import CutPlan
from fxshard.ir.layout import (  # noqa: F401  (the layout's names, for the passes' one import)
    CP,
    CPTP,
    DP,
    DPCP,
    DTYPES,
    EDP,
    EP,
    INTERLEAVED,
    MESH_AXES,
    PP,
    RECOMPUTE,
    SCHEDULES,
    TP,
    Coords,
    Layout,
)
from fxshard.ir.rows import BatchRows
from fxshard.ir.sequence import SequenceDims
from fxshard.ir.spec import Group, NodeSpec, RankValue, spec, update_spec  # noqa: F401  (the node facts' names)

if TYPE_CHECKING:  # CompileContext carries the resolved plan: a type above ir (the plan reads ir's placements)
    from fxshard.plan.styles import ResolvedPlan


@dataclass
class CompileContext:
    layout: Layout
    program: Program
    plan: ResolvedPlan
    params: set[fx.Node] = field(default_factory=set)
    user_inputs: set[fx.Node] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    passes_run: list[str] = field(default_factory=list)
    model_file_name: str = "model.py"
    model_digest: str = ""
    split_before: list[str] = field(default_factory=list)  # explicit pipeline cuts (module FQNs)
    microbatches: int = 1
    batch: int | None = None  # examples per step (the leading size of the inputs)
    pipeline: CutPlan | None = None  # passes/pipeline.py, when pp > 1: the cut (its stages: fxshard.ir.stages)
    token_count: fx.GraphModule | None = None  # passes/token_mean.py: inputs -> counted targets of a microbatch
    expert_params: dict[str, int] = field(default_factory=dict)  # passes/expert_parallel.py: FQN -> experts (dim 0)
    sequence: SequenceDims | None = None  # under --cp: each captured value's sequence dimensions (fxshard.ir.sequence)
    # where the batch is split (--dp, microbatches): each value's placement over the batch's rows, and the ops that mix
    # them (fxshard.ir.rows)
    rows: BatchRows | None = None
    # passes/batch_norm_sync.py: the ops that mix the examples of the batch (batch norm in training), which
    # --grad-accum cannot make exact (the manifest lists them)
    batch_couplings: list[str] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)  # passes/collectives.py: parts several tp ranks hold alike
    unsplit: Any = None  # passes/tensor_parallel.py: what tp leaves whole (fxshard.plan.unsplit.Unsplit)

    @property
    def trainable(self) -> set[fx.Node]:
        """The parameters that train (``requires_grad``): what gradients flow back to.  A frozen parameter is in
        :attr:`params` (split, loaded and saved as any) and not here::

            grad = requires_grad(gm, ctx.trainable)
        """
        state = self.program.state_by_name()
        return {n for n in self.params if state[n.name].trainable}

    @property
    def plan_summary(self) -> list[str]:
        """The plan's lines (layers of a list as one ``*`` line), then what holds parts several tp ranks share."""
        return compress_plan(self.plan.describe()) + self.replicas


def compress_plan(lines: list[str]) -> list[str]:
    """``layers.0.mlp.fc: colwise()`` ... ``layers.7.mlp.fc: colwise()`` -> ``layers.*.mlp.fc: colwise()``."""
    groups: dict[str, list[str]] = {}
    for line in lines:
        fqn, rest = line.split(": ", 1)
        key = ".".join("*" if p.isdigit() else p for p in fqn.split(".")) + ": " + rest
        groups.setdefault(key, []).append(line)
    out = []
    for key, members in groups.items():
        out.append(key if len(members) > 1 else members[0])
    return out
