"""State shared by the passes: the layout, the captured program, and per-node facts.

Pass-to-pass facts about a node live under one key, ``node.meta["fxshard"]``, as a frozen
:class:`NodeSpec`.  Everything else a pass learns goes into the :class:`CompileContext`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxshard.capture.program import Program
from fxshard.errors import LayoutError
from fxshard.ir.placement import Placement, Replicate
from fxshard.plan.styles import ResolvedPlan

if TYPE_CHECKING:  # fxshard.ir.cut reads the Layout defined here
    from fxshard.ir.cut import CutPlan

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
INTERLEAVED = ("interleaved-1f1b", "zero-bubble")  # schedules that take several stages per rank
DP, PP, TP = "dp", "pp", "tp"  # the mesh axes, by name
MESH_AXES = (DP, PP, TP)  # outermost first: a tp group is consecutive ranks
# expert parallelism is carved out of dp (Megatron-Core, torchtitan): dp coordinate d is ep rank d % ep of the ep
# group of d // ep; the ranks holding the same experts (d % ep equal) form its expert-data-parallel ("edp") group
EP, EDP = "ep", "edp"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # --dtype: the compute dtype; master weights stay fp32
RECOMPUTE = ("none", "selective", "full", "auto")  # --recompute: what a repeated block keeps for backward; auto:
# the least of the three that fits --device-memory by the plan (fxshard.tools.costs.choose_recompute), resolved
# before code generation
_ADDED = ("virtual_stages", "dtype", "recompute", "sp", "ep", "overlap")  # Layout fields newer than manifest format 1: absent
# from older manifests
_SINCE_DEFAULT = {"recompute": "none", "sp": False, "ep": 1, "overlap": True}  # written only when set: manifests before them stay byte
# for byte


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int | None = None  # stages per pp rank; interleaved schedules default to 2
    dtype: str = "fp32"  # compute dtype of the generated code; "bf16": mixed precision, fp32 master weights
    recompute: str = "none"  # activation recompute of the repeated blocks: none, selective, full (or auto, resolved)
    sp: bool = False  # sequence parallelism: what runs between tp regions runs on S/tp tokens (passes/collectives.py)
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep ranks of dp (passes/expert_parallel.py)
    # copy_to + the column-parallel linears reading it written as rt.copy_to_linears: backward overlaps the input
    # gradient's all-reduce with the weight gradients (fxshard/codegen/emit.py); False: plain copy_to and linears
    overlap: bool = True

    def __post_init__(self):
        for axis in ("tp", "pp", "dp", "ep"):
            if getattr(self, axis) < 1:
                raise LayoutError(f"--{axis} must be at least 1, got {getattr(self, axis)}")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.virtual_stages is not None:
            if self.virtual_stages < 1:
                raise LayoutError(f"--virtual-stages must be at least 1, got {self.virtual_stages}")
            if self.virtual_stages > 1 and self.schedule not in INTERLEAVED:
                raise LayoutError(
                    f"--virtual-stages {self.virtual_stages}: schedule {self.schedule} runs one stage per pp rank; "
                    f"use --schedule {' or '.join(INTERLEAVED)} for several stages per rank, or drop the flag"
                )
        if self.zero == 3 and self.dp > 1 and self.pp > 1 and self.schedule == "zero-bubble":
            # torch's split backward collects the parameters when its input-gradient pass starts; after a
            # forward, FSDP2 has resharded them, so that pass finds none in the graph (torch 2.13 stage.py)
            raise LayoutError(
                "--zero 3 with --schedule zero-bubble: torch's zero-bubble schedule collects each stage's "
                "parameters for the weight-gradient pass after FSDP2 has resharded them, so most microbatches' "
                "weight gradients would never be computed (the run would train wrongly, not fail); use --zero 2 "
                "(parameters stay gathered between forward and backward) or another --schedule (gpipe, 1f1b, "
                "interleaved-1f1b) with --zero 3"
            )
        if self.dtype not in DTYPES:
            raise LayoutError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.recompute not in RECOMPUTE:
            raise LayoutError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.sp and self.tp == 1:
            raise LayoutError("--sp splits the sequence over the tensor-parallel ranks, and tp=1 has one: nothing "
                              "would be split; use --tp 2 or more with --sp, or drop --sp")
        if self.microbatches is not None and self.microbatches < 1:
            raise LayoutError(f"--microbatches must be at least 1, got {self.microbatches}")
        if self.ep > 1:
            self._check_ep()

    def _check_ep(self) -> None:
        """ep is carved out of dp (every other flag composes with it: the README's table)."""
        if self.dp % self.ep:
            ok = [e for e in range(1, self.dp + 1) if self.dp % e == 0]
            raise LayoutError(f"--ep {self.ep}: expert parallelism is carved out of the {self.dp} data-parallel ranks, "
                              f"so ep must divide dp; use --ep in {ok} or --dp a multiple of {self.ep}")

    @property
    def mixed(self) -> bool:
        """Mixed precision: bf16 parameters, activations and gradients; fp32 master weights and Adam state."""
        return self.dtype != "fp32"

    @property
    def compute_dtype(self) -> torch.dtype:
        return getattr(torch, DTYPES[self.dtype])

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.size(axis) for axis in MESH_AXES)

    def size(self, axis: str) -> int:
        """The number of ranks along mesh ``axis`` (``edp``: the dp ranks holding the same experts)."""
        return self.dp // self.ep if axis == EDP else getattr(self, axis)

    def ep_rank(self, dp_rank: int) -> int:
        """The ep coordinate of dp coordinate ``dp_rank``: which 1/ep of each MoE layer's experts it holds."""
        return dp_rank % self.ep

    def expert_groups(self) -> dict[str, list[list[int]]]:
        """The global ranks of every ep group (consecutive dp coordinates) and every edp group (the same
        experts), per (pp, tp) coordinate: ``Layout(dp=4, ep=2).expert_groups()["ep"] == [[0, 1], [2, 3]]``."""
        groups: dict[str, list[list[int]]] = {EP: [], EDP: []}
        for p in range(self.pp):
            for t in range(self.tp):
                for g in range(self.dp // self.ep):
                    groups[EP].append([self.rank_of(g * self.ep + e, p, t) for e in range(self.ep)])
                for e in range(self.ep):
                    groups[EDP].append([self.rank_of(g * self.ep + e, p, t) for g in range(self.dp // self.ep)])
        return groups

    @property
    def stages_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.schedule == "interleaved-1f1b" else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_rank(self, stage: int) -> int:
        """The pp coordinate holding ``stage``: stages loop over the pp ranks (0, 1, .., pp-1, 0, 1, ..)."""
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank, self.num_stages, self.pp))

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank; the innermost axis (tp) varies fastest."""
        coords = {}
        for axis in reversed(MESH_AXES):
            rank, coords[axis] = divmod(rank, self.size(axis))
        return {axis: coords[axis] for axis in MESH_AXES}

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        rank = 0
        for axis, index in zip(MESH_AXES, (dp, pp, tp), strict=True):
            rank = rank * self.size(axis) + index
        return rank

    def to_json(self) -> dict:
        """Every field by name, in order: the manifest's ``layout`` (:meth:`from_json` reads it back); a field
        newer than the manifest format is written only when it differs from its default, so a manifest
        without it reads and writes back the same bytes."""
        data = dataclasses.asdict(self)
        return {k: v for k, v in data.items() if k not in _SINCE_DEFAULT or v != _SINCE_DEFAULT[k]}

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        """The layout :meth:`to_json` wrote; fields that manifests of older fxshards lack take their default."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data or f.name not in _ADDED})

    def describe(self) -> str:
        text = f"tp={self.tp} pp={self.pp} dp={self.dp} zero={self.zero}"
        if self.ep > 1:
            text += f" ep={self.ep}"
        if self.pp > 1:
            text += f" schedule={self.schedule} microbatches={self.microbatches}"
            if self.stages_per_rank > 1:
                text += f" virtual-stages={self.stages_per_rank}"
        if self.mixed:
            text += f" dtype={self.dtype}"
        if self.recompute != "none":
            text += f" recompute={self.recompute}"
        if self.sp:
            text += " sp"
        if not self.overlap:
            text += " no-overlap"
        return text


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
