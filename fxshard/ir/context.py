"""State shared by the passes: the layout, the captured program, and per-node facts.

Pass-to-pass facts about a node live under one key, ``node.meta["fxshard"]``, as a frozen
:class:`NodeSpec`.  Everything else a pass learns goes into the :class:`CompileContext`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

from fxshard.capture.program import Program
from fxshard.ir.layout import (  # noqa: F401  (the layout's names, for the passes' one import)
    DP,
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
from fxshard.ir.placement import Placement, Replicate
from fxshard.plan.styles import ResolvedPlan

if TYPE_CHECKING:
    from fxshard.ir.cut import CutPlan


@dataclass(frozen=True)
class RankValue:
    """An argument whose value depends on the rank's coordinate on one mesh axis (e.g. a vocab offset)."""

    axis: str
    values: tuple

    def at(self, coords: Coords):
        return self.values[coords[self.axis]]


@dataclass(frozen=True)
class Group:
    """A process group argument of a collective: the mesh axis it communicates over."""

    axis: str

    def __str__(self) -> str:
        return self.axis


@dataclass(frozen=True)
class NodeSpec:
    """What the passes decided for one node: the one place a pass leaves a per-node fact for a later one.

    It lives in the graph with its node, so a pass that inserts or replaces nodes carries the facts along
    (or leaves the defaults, which say "not decided") instead of leaving a side table pointing at old nodes.
    """

    placement: Placement | tuple[Placement, ...] = Replicate()  # tensor_parallel: the output's placement on tp
    fqn: str = ""
    role: str = ""  # e.g. "column-parallel"; "" for ordinary compute
    collective: str = ""  # e.g. "all_reduce" for inserted communication
    # tensor_parallel -> collectives: the placement each tensor input (``tensor_args`` order) must have; the
    # collectives pass inserts a redistribution where an input has another.  None: the node takes its inputs
    # as they are (communication the collectives pass inserted)
    inputs: tuple[Placement, ...] | None = None
    # tensor_parallel -> collectives: a replicated node where split compute begins (an experts module's dispatch,
    # fxshard.ir.experts.dispatch_chain): its replicated inputs that need a gradient enter through copy_to (or
    # gather_to) here, as a split node's would, and its consumers read it without another
    enters: bool = False
    # capture (``label_markers``) -> pipeline: the number of fxshard.pipeline_split() markers before the node in
    # the forward.  None for nodes the passes inserted: they run with the next labelled node
    segment: int | None = None
    # pipeline: the stage computing the node (pp > 1).  None where no stage computes it: pp = 1, placeholders,
    # what only the model's other outputs need.  What crosses stages is derived from these (fxshard.ir.stages)
    stage: int | None = None


def spec(node: fx.Node) -> NodeSpec:
    return node.meta.get("fxshard", NodeSpec())


def update_spec(node: fx.Node, **changes) -> None:
    """Change some facts of ``node``'s (frozen) :class:`NodeSpec`, keeping the others::

        update_spec(node, stage=1)
    """
    node.meta["fxshard"] = dataclasses.replace(spec(node), **changes)


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

    @property
    def plan_summary(self) -> list[str]:
        return compress_plan(self.plan.describe())


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
