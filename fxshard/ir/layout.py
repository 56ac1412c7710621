"""The layout of a compiled program: the mesh its ranks form, and the flags that choose how it trains.

Its fields are the layout flags of ``fxshard compile``, ``plan`` and ``verify``, declared once (:mod:`fxshard.flags`).
The mesh's axes have one home, here: ``MESH_AXES`` are its dimensions, outermost first (a tp group is
consecutive ranks); expert parallelism's ``ep`` and ``edp`` are carved out of ``dp``; context parallelism's ``cp``
sits between dp and pp, and gradients are averaged over ``dp_cp``, the two flattened (world = dp·cp·pp·tp).  Code
that names an axis uses these constants, never the quoted name.  :meth:`Layout.process_groups` builds every process
group a rank's program uses, once, the way torchtitan's ``ParallelDims.build_mesh`` does::

    >>> Layout(tp=2, pp=2, dp=2).mesh_shape, Layout(dp=4, ep=2).size(EDP), Layout(dp=2, cp=2).mesh_axes
    ((2, 2, 2), 2, ('dp', 'cp', 'pp', 'tp'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxshard.errors import LayoutError
from fxshard.flags import option

if TYPE_CHECKING:
    import torch

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
INTERLEAVED = ("interleaved-1f1b", "zero-bubble")  # schedules that take several stages per rank
DP, CP, PP, TP = "dp", "cp", "pp", "tp"  # the mesh axes, by name
MESH_AXES = (DP, CP, PP, TP)  # outermost first: a tp group is consecutive ranks; cp only when --cp > 1 (mesh_axes)
DPCP = "dp_cp"  # dp and cp flattened: the ranks that hold the same parameters and average their gradients (--cp)
CPTP = "cp_tp"  # cp and tp flattened (--cp and --tp with fp8): an fp8 linear's amaxes span its tokens (cp) and weight (tp)
# --cp-mode: how attention exchanges keys and values (passes/context_parallel.py)
CP_MODES = ("allgather", "ring", "a2a")
# expert parallelism is carved out of dp (Megatron-Core, torchtitan): dp coordinate d is ep rank d % ep of the ep
# group of d // ep; the ranks holding the same experts (d % ep equal) form its expert-data-parallel ("edp") group
EP, EDP = "ep", "edp"
SIZED_AXES = (*MESH_AXES, EP)  # the axes a --flag sizes
TIED = "tied:"  # a tied-weight group's name: "tied:<fqn>" (the weight held by stages on several pp ranks)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}  # --dtype: the compute dtype; master weights stay
# fp32; fp8 is bf16 with the linears' products in float8 (--fp8's recipe, tensorwise by default: docs/fp8.md)
FP8_RECIPES = ("tensorwise", "rowwise")  # --fp8: torchao's float8 training recipes (fxshard/runtime/fp8.py)
RECOMPUTE = ("none", "selective", "full", "auto")  # --recompute: what a repeated block keeps for backward; auto:
# the least of the three that fits --device-memory by the plan (fxshard.cost.costs.choose_recompute), resolved
# before code generation
_ADDED = ("virtual_stages", "dtype", "recompute", "sp", "ep", "overlap", "cp", "cp_mode", "lora", "lora_alpha",
          "lora_targets", "lora_dropout", "fp8")  # Layout fields newer than manifest format 1: absent
# from older manifests
_SINCE_DEFAULT = {"recompute": "none", "sp": False, "ep": 1, "overlap": True, "cp": 1, "cp_mode": "allgather",
                  "lora": None, "lora_alpha": None, "lora_targets": None, "lora_dropout": None,
                  "fp8": None}  # written only when set: manifests before them stay byte
# for byte


@dataclass(frozen=True)
class Coords:
    """A rank's place on the mesh: its index on each axis of ``MESH_AXES``, and under ``--ep`` which experts it holds
    (its dp index modulo ep; None without expert parallelism); ``cp`` is None without context parallelism.  A
    manifest's rank file sits at ``dp=0`` (and ``cp=0``: every cp rank runs it, reading its index from its group)::

        >>> Layout(tp=2, dp=4, ep=2).coords(7)
        Coords(dp=3, pp=0, tp=1, ep=1)
        >>> Coords(pp=1, tp=0)[TP], Coords(pp=1).to_json()
        (0, {'dp': 0, 'pp': 1, 'tp': 0})
    """

    dp: int = 0
    pp: int = 0
    tp: int = 0
    ep: int | None = None
    cp: int | None = None

    def __getitem__(self, axis: str) -> int:
        """The index on ``axis`` by name, for code over any axis (a ``RankValue``'s, a ``Group``'s)."""
        if axis not in _COORD_AXES or getattr(self, axis) is None:
            raise KeyError(f"{self} has no index on axis {axis!r}")
        return getattr(self, axis)

    def __repr__(self) -> str:
        ep = f", ep={self.ep}" if self.ep is not None else ""
        cp = f", cp={self.cp}" if self.cp is not None else ""
        return f"Coords(dp={self.dp}, pp={self.pp}, tp={self.tp}{ep}{cp})"

    def replace(self, **index: int | None) -> Coords:
        return dataclasses.replace(self, **index)

    def to_json(self) -> dict[str, int]:
        """``{"dp": d, "pp": p, "tp": t}`` (and ``"ep"`` under ``--ep``, ``"cp"`` under ``--cp``): the manifest's
        ``coords``."""
        return {axis: getattr(self, axis) for axis in _COORD_AXES if getattr(self, axis) is not None}

    @classmethod
    def from_json(cls, data: dict) -> Coords:
        if not isinstance(data, dict) or not set(data) <= set(_COORD_AXES) or not all(
                isinstance(v, int) for v in data.values()):
            raise ValueError(f"{data!r} are not mesh coordinates (a dict of {', '.join(_COORD_AXES)} to indices)")
        return cls(**data)


_COORD_AXES = tuple(f.name for f in dataclasses.fields(Coords))


@dataclass(frozen=True)
class Layout:
    # each field is an option of `fxshard compile`, `plan` and `verify` (fxshard.flags), with this help
    tp: int = option(1, "tensor-parallel degree")
    pp: int = option(1, "pipeline-parallel degree")
    dp: int = option(1, "data-parallel degree")
    zero: int = option(0, "ZeRO stage (0-3)")
    schedule: str = option("1f1b", f"pipeline schedule: {', '.join(SCHEDULES)}")
    microbatches: int | None = option(None, "pipeline microbatches per step (default: the fewest the schedule runs "
                                            "well with that divide the batch)")
    virtual_stages: int | None = option(None, "stages per pp rank for interleaved-1f1b (default 2) and zero-bubble "
                                              "(default 1)")
    # the compute dtype of the generated code; bf16: mixed precision, fp32 master weights
    dtype: str = option("fp32", "fp32; bf16: mixed precision (bf16 compute, fp32 master weights and Adam state); fp8: "
                                "bf16 with the linears' products in float8 (--fp8's recipe, default tensorwise)")
    # activation recompute of the repeated blocks (auto is resolved by the driver before the compile)
    recompute: str = option("none", "activation recompute of each repeated block: none; selective (keep matmul "
                                    "outputs, recompute the rest in backward); full (keep only the block's inputs); "
                                    "auto (the least of these that fits --device-memory by the plan)")
    # sequence parallelism (passes/collectives.py)
    sp: bool = option(False, "sequence parallelism (with --tp 2 or more): norms, dropout and residual adds run on S/tp "
                             "tokens; the all-reduces become reduce-scatters and all-gathers")
    # expert parallelism (passes/expert_parallel.py)
    ep: int = option(1,
                     "expert-parallel degree: each MoE layer's experts split over ep of the dp ranks (ep divides dp)")
    # copy_to + the column-parallel linears reading it fused as rt.copy_to_linears: backward overlaps the input
    # gradient's all-reduce with the weight gradients (passes/overlap.py); under --sp the linears reading a gather_to
    # as rt.linears_regathered (they keep its shard, gathered again in backward); False: plain copy_to and linears
    overlap: bool = option(True, "write copy_to and the column-parallel linears reading it as one rt.copy_to_linears, "
                                 "whose backward overlaps the input gradient's all-reduce with the weight gradients "
                                 "(same values, same bytes); under --sp, the linears reading a gather_to as one "
                                 "rt.linears_regathered, which keeps the shard for backward (1/tp of the bytes) and "
                                 "gathers it again there")
    # context parallelism (passes/context_parallel.py): the sequence split over cp ranks
    cp: int = option(1, "context-parallel degree: every activation split along the sequence over cp ranks (causal "
                        "models load-balanced: 2*cp chunks, rank i holds chunks i and 2*cp-1-i); parameters "
                        "replicated over cp, gradients averaged over dp x cp")
    cp_mode: str = option("allgather", "how attention sees the other cp ranks' keys and values: allgather (all-gather "
                                       "K/V, reduce-scatter their gradients), ring (send/recv K/V blocks around the cp "
                                       "ring, log-sum-exp merges), a2a (Ulysses: all-to-all from a sequence to a head "
                                       "split around attention)")
    # LoRA (fxshard/capture/lora.py applies peft's before capture; fxshard/plan/lora.py places the adapters)
    lora: int | None = option(None, "LoRA rank: peft's LoRA adapters on the --lora-targets linears, the rest of the "
                                    "model frozen (no gradient, no optimizer state); the adapters follow their base's "
                                    "split (docs/lora.md)")
    lora_alpha: float | None = option(None, "LoRA alpha (the adapters' output is scaled by alpha/rank; default 8, as "
                                            "peft's LoraConfig)")
    lora_targets: str | None = option(None, "comma-separated modules to adapt: names or globs matched against the end "
                                            "of each module path, as peft's target_modules (q_proj,v_proj; "
                                            "layers.0.*.q_proj); default: peft's list for the model type")
    lora_dropout: float | None = option(None, "dropout on the adapters' input (default 0)")
    # FP8 linears (passes/fp8.py, fxshard/runtime/fp8.py): torchao's recipe on every eligible nn.Linear
    fp8: str | None = option(None, "float8 products in the linears with torchao's recipe: tensorwise or rowwise "
                                   "(dynamic scales; e4m3, e5m2 gradients under tensorwise); the rest computes at "
                                   "--dtype (--dtype fp8: bf16); docs/fp8.md")

    def __post_init__(self):
        for axis in (TP, PP, DP, EP, CP):
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
        if self.cp_mode not in CP_MODES:
            raise LayoutError(f"--cp-mode must be one of {', '.join(CP_MODES)}, got {self.cp_mode!r}")
        if self.cp == 1 and self.cp_mode != "allgather":
            raise LayoutError(f"--cp-mode {self.cp_mode} applies to context parallelism (--cp 2 or more); add --cp N "
                              "or drop --cp-mode")
        for flag, value, unset in (("--microbatches", self.microbatches, (None, 1)),
                                   ("--schedule", self.schedule, ("1f1b",)),
                                   ("--virtual-stages", self.virtual_stages, (None, 1))):
            if self.pp == 1 and value not in unset:  # a pipeline's own flag without a pipeline: refused, not ignored
                raise LayoutError(f"{flag} {value} applies to pipeline parallelism (--pp > 1); leave it unset at "
                                  "--pp 1")
        self._check_lora()
        self._check_fp8()

    def _check_fp8(self) -> None:
        """``--fp8`` and ``--dtype fp8`` (their module: fxshard/runtime/fp8.py)."""
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise LayoutError(f"--fp8 must be one of {', '.join(FP8_RECIPES)}, got {self.fp8!r}")
        if self.fp8_recipe == "rowwise" and self.cp > 1 and self.tp > 1:
            raise LayoutError(f"--cp {self.cp} --tp {self.tp} with --fp8 rowwise: its scales per token need amaxes over "
                              "tp alone and its scales per feature over the tokens amaxes over cp as well, two "
                              "reductions where an fp8 call makes one; use --fp8 tensorwise (--dtype fp8), --tp 1, or "
                              "drop --cp")

    def _check_lora(self) -> None:
        """``--lora R`` and the flags that only mean something with it (their module: fxshard/capture/lora.py)."""
        given = [f"--{n.replace('_', '-')}" for n in ("lora_alpha", "lora_targets", "lora_dropout")
                 if getattr(self, n) is not None]
        if self.lora is None:
            if given:
                raise LayoutError(f"{', '.join(given)} set{'s' * (len(given) == 1)} up LoRA adapters, and --lora "
                                  "(their rank) is not given; add --lora R (e.g. --lora 16) or drop "
                                  f"{'it' if len(given) == 1 else 'them'}")
            return
        if self.lora < 1:
            raise LayoutError(f"--lora {self.lora}: a LoRA rank is the inner size of each adapter (A: rank x in, B: "
                              "out x rank) and must be at least 1; use e.g. --lora 16, or drop --lora to train every "
                              "parameter")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise LayoutError(f"--lora-dropout {self.lora_dropout}: a dropout probability is in [0, 1)")
        if self.lora_targets is not None and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise LayoutError(f"--lora-targets {self.lora_targets!r} names no module; give module names such as "
                              "q_proj,v_proj")

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
    def fp8_recipe(self) -> str | None:
        """The float8 recipe of the linears (``--fp8``; ``--dtype fp8`` alone: tensorwise), None without fp8."""
        return self.fp8 or ("tensorwise" if self.dtype == "fp8" else None)

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh's dimensions, outermost first: ``MESH_AXES`` without ``cp`` at ``--cp 1`` (so folders compiled
        without context parallelism keep their three-axis mesh, byte for byte)."""
        return MESH_AXES if self.cp > 1 else tuple(a for a in MESH_AXES if a != CP)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.size(axis) for axis in self.mesh_axes)

    @property
    def replicas(self) -> int:
        """The ranks holding the same parameters and averaging their gradients: dp, times cp under ``--cp``."""
        return self.dp * self.cp

    @property
    def grad_axis(self) -> str:
        """The group whose ranks hold the same parameters and average their gradients: dp, or dp x cp (``dp_cp``)."""
        return DPCP if self.cp > 1 else DP

    def size(self, axis: str) -> int:
        """The number of ranks along mesh ``axis`` (``edp``: the ranks holding the same experts, dp/ep of them times cp
        under ``--cp``; ``dp_cp``: dp times cp; ``cp_tp``: cp times tp)."""
        if axis == EDP:
            return self.dp // self.ep * self.cp
        if axis == CPTP:
            return self.cp * self.tp
        return self.dp * self.cp if axis == DPCP else getattr(self, axis)

    def ep_rank(self, dp_rank: int) -> int:
        """The ep coordinate of dp coordinate ``dp_rank``: which 1/ep of each MoE layer's experts it holds."""
        return dp_rank % self.ep

    def expert_groups(self) -> dict[str, list[list[int]]]:
        """The global ranks of every ep group (consecutive dp coordinates, one cp coordinate) and every edp group (the
        same experts: over dp and, under ``--cp``, over cp), per (pp, tp) coordinate:
        ``Layout(dp=4, ep=2).expert_groups()["ep"] == [[0, 1], [2, 3]]``."""
        groups: dict[str, list[list[int]]] = {EP: [], EDP: []}
        cps = [{"cp": c} for c in range(self.cp)] if self.cp > 1 else [{}]
        for p in range(self.pp):
            for t in range(self.tp):
                for c in cps:
                    for g in range(self.dp // self.ep):
                        groups[EP].append([self.rank_of(dp=g * self.ep + e, pp=p, tp=t, **c) for e in range(self.ep)])
                for e in range(self.ep):
                    groups[EDP].append([self.rank_of(dp=g * self.ep + e, pp=p, tp=t, **c)
                                        for g in range(self.dp // self.ep) for c in cps])
        return groups

    def process_groups(self, device_type: str, tied: Mapping[str, Sequence[int]] | None = None) -> ProcessGroups:
        """Every process group this rank's program uses, built here alone (a rank of the initialized default group).

        The dp x pp x tp mesh (dp x cp x pp x tp under ``--cp``, with dp and cp flattened into ``dp_cp``) is torch's
        ``DeviceMesh``; under ``--ep`` its dp dimension is unflattened into
        edp x ep (dp coordinate ``d`` is ep rank ``d % ep``); ``tied`` (group name -> stages holding the weight,
        the manifest's ``tied_across_stages``) adds one group per weight held on several pp ranks, per (dp, tp)
        coordinate.  Building a group is collective over the world, so every rank builds all of them, in this order::

            groups = layout.process_groups("cpu", {"tied:lm_head.weight": (0, 3)})
            groups[TP], groups[EP], groups["tied:lm_head.weight"], groups.mesh_of(DP)
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_axes)
        meshes = {axis: mesh[axis] for axis in self.mesh_axes}
        if self.cp > 1:  # torchtitan's dp_shard_cp: the ranks that average gradients and shard ZeRO state
            meshes[DPCP] = mesh[DP, CP]._flatten(DPCP)
        if self.cp > 1 and self.tp > 1 and self.fp8_recipe is not None:  # fp8 amaxes over the tokens and the weight
            meshes[CPTP] = mesh[CP, TP]._flatten(CPTP)
        if self.ep > 1 and self.cp > 1:  # the same experts on every cp rank: edp spans the dp/ep groups and cp
            experts = mesh._unflatten(0, (self.dp // self.ep, self.ep), ("edp_dp", EP))
            meshes |= {EP: experts[EP], EDP: experts["edp_dp", CP]._flatten(EDP)}
        elif self.ep > 1:  # torchtitan's ParallelDims carves ep out of its dp dimensions the same way
            experts = mesh[DP]._unflatten(0, (self.dp // self.ep, self.ep), (EDP, EP))
            meshes |= {axis: experts[axis] for axis in (EDP, EP)}
        groups = {axis: m.get_group() for axis, m in meshes.items()}
        rank = dist.get_rank()
        for name, stages in (tied or {}).items():
            pp_ranks = sorted({self.stage_rank(s) for s in stages})
            if len(pp_ranks) < 2:
                continue
            for d in range(self.dp):
                for c in range(self.cp):
                    for t in range(self.tp):
                        at = {"cp": c} if self.cp > 1 else {}
                        ranks = [self.rank_of(dp=d, pp=p, tp=t, **at) for p in pp_ranks]
                        group = dist.new_group(ranks)
                        if rank in ranks:
                            groups[name] = group
        return ProcessGroups(meshes, groups)

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

    def coords(self, rank: int) -> Coords:
        """Mesh coordinates of a global rank; the innermost axis (tp) varies fastest; under ``--ep``, its ep index."""
        index = {}
        for axis in reversed(self.mesh_axes):
            rank, index[axis] = divmod(rank, self.size(axis))
        return Coords(**index, ep=self.ep_rank(index[DP]) if self.ep > 1 else None)

    def rank_of(self, coords: Coords | None = None, **index: int) -> int:
        """The global rank at ``coords``, or at the mesh indices named (the others 0): ``rank_of(dp=1, tp=1)``."""
        coords = coords if coords is not None else Coords(**index)
        rank = 0
        for axis in self.mesh_axes:
            rank = rank * self.size(axis) + ((coords.cp or 0) if axis == CP else coords[axis])
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
        if self.cp > 1:
            text += f" cp={self.cp} cp-mode={self.cp_mode}"
        if self.pp > 1:
            text += f" schedule={self.schedule} microbatches={self.microbatches}"
            if self.stages_per_rank > 1:
                text += f" virtual-stages={self.stages_per_rank}"
        if self.mixed:
            text += f" dtype={self.dtype}"
        if self.fp8 is not None:
            text += f" fp8={self.fp8}"
        if self.recompute != "none":
            text += f" recompute={self.recompute}"
        if self.sp:
            text += " sp"
        if not self.overlap:
            text += " no-overlap"
        if self.lora is not None:
            text += f" lora={self.lora}"
        return text


class ProcessGroups(Mapping):
    """The process groups of one rank's program by name (:meth:`Layout.process_groups`): each mesh axis, ``ep`` and
    ``edp`` under ``--ep``, ``cp`` and ``dp_cp`` under ``--cp`` (and ``cp_tp`` with ``--tp`` and fp8), ``tied:<fqn>``
    under pipeline parallelism.  A rank file's ``RankModule(groups, device)`` reads it as a mapping; :meth:`mesh_of`
    gives the 1-D ``DeviceMesh`` of an axis (FSDP2 shards over dp's)."""

    def __init__(self, meshes: dict, groups: dict):
        self._meshes, self._groups = meshes, groups

    def __getitem__(self, name: str):
        return self._groups[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def mesh_of(self, axis: str):
        """The ``DeviceMesh`` of mesh axis ``axis`` alone (one dimension)."""
        return self._meshes[axis]
