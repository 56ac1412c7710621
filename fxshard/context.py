"""State shared by the passes: the layout, the captured program, and per-node facts.

Pass-to-pass facts about a node live under one key, ``node.meta["fxshard"]``, as a frozen
:class:`NodeSpec`.  Everything else a pass learns goes into the :class:`CompileContext`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fxshard.capture import Program
from fxshard.errors import LayoutError
from fxshard.placement import Placement, Replicate
from fxshard.plan import ResolvedPlan

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
MESH_AXES = ("dp", "pp", "tp")  # outermost first: a tp group is consecutive ranks


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int | None = None

    def __post_init__(self):
        for axis in ("tp", "pp", "dp"):
            if getattr(self, axis) < 1:
                raise LayoutError(f"--{axis} must be at least 1, got {getattr(self, axis)}")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank; tp varies fastest."""
        return {"dp": rank // (self.pp * self.tp), "pp": rank // self.tp % self.pp, "tp": rank % self.tp}

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} zero={self.zero}"


@dataclass(frozen=True)
class RankValue:
    """An argument whose value depends on the rank's coordinate on one mesh axis (e.g. a vocab offset)."""

    axis: str
    values: tuple

    def at(self, coords: dict[str, int]):
        return self.values[coords[self.axis]]


@dataclass(frozen=True)
class Group:
    """A process group argument of a collective: the mesh axis it communicates over."""

    axis: str

    def __str__(self) -> str:
        return self.axis


@dataclass(frozen=True)
class NodeSpec:
    """What the passes decided for one node."""

    placement: Placement | tuple[Placement, ...] = Replicate()
    fqn: str = ""
    role: str = ""  # e.g. "column-parallel"; "" for ordinary compute
    collective: str = ""  # e.g. "all_reduce" for inserted communication


def spec(node: fx.Node) -> NodeSpec:
    return node.meta.get("fxshard", NodeSpec())


@dataclass
class CompileContext:
    layout: Layout
    program: Program
    plan: ResolvedPlan
    params: set[fx.Node] = field(default_factory=set)
    user_inputs: set[fx.Node] = field(default_factory=set)
    weight_placements: dict[str, Placement] = field(default_factory=dict)  # placeholder name -> placement
    needs_grad: set[fx.Node] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    passes_run: list[str] = field(default_factory=list)
    model_file_name: str = "model.py"
    model_digest: str = ""

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
