"""The manifest of a compiled output folder (``manifest.json``): its typed form, written and read here alone.

The compiler builds a :class:`Manifest` and :meth:`Manifest.write` saves it; every reader (``check``,
``run``, ``show``, ``verify``, checkpoints) gets one from :func:`read_manifest` and reads attributes, never
the JSON.  All validation of a folder lives here too: the format, paths that must stay inside the folder
(:func:`inside`), the digests of the generated files, and files the manifest lists but the folder lacks::

    manifest = read_manifest("out/gpt-tp2")
    manifest.layout.tp, manifest.ranks[1].file        # 2, 'rank_pp0_tp1.py'
    manifest.ranks[1].tensors["lm_head_weight"].slice  # SliceSpec(dim=0, index=1, parts=2, blocks=1)
    manifest.ranks[1].tensors["lm_head_weight"].placements  # {'tp': Shard(0)}
    manifest.ranks[1].coords                          # Coords(dp=0, pp=0, tp=1)

The JSON is format 2 (:data:`FORMAT`): reading then writing a manifest gives back the same bytes.  A folder of
format 1 (placements as ``repr`` text) is refused with "recompile", and is still fxshard's to compile over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from fxshard.errors import OutputFolderError
from fxshard.ir.layout import TP, Coords, Layout
from fxshard.ir.placement import Placement, Replicate, Shard, placement_from_json
from fxshard.pyfile import import_file
from fxshard.runtime.slices import SliceSpec

MANIFEST = "manifest.json"
# 2: each tensor's placements typed, per mesh axis ({"tp": {"kind": "shard", "dim": 0}}); format 1 wrote one repr
# string and the axis beside it.  Folders of format 1 are refused with "recompile" (a compile is deterministic and
# takes seconds; checkpoints hold slices, not placements, and resume into the recompiled folder)
FORMAT = 2
READ_BEFORE = (1,)  # formats fxshard wrote before: their folders are still fxshard's to overwrite


class _Record:
    """A record whose JSON object holds its fields by name, in order; tuples are JSON lists."""

    def to_json(self) -> dict:
        return {f.name: _json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict):
        # a field with a default may be missing from a folder an older fxshard wrote
        return cls(**{f.name: _tuple(data[f.name]) for f in dataclasses.fields(cls)
                      if f.name in data or f.default is dataclasses.MISSING})


def _json(value):
    return [_json(v) for v in value] if isinstance(value, tuple) else value


def _tuple(value):
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class InputEntry(_Record):
    """One input of the compiled forward: where a batch holds it, and its shape for a whole step and for the
    microbatch of one dp rank that the rank files take."""

    name: str
    path: str  # pytree key path into (args, kwargs), e.g. "[1]['input_ids']"
    is_tensor: bool
    dtype: str
    shape: tuple[int, ...]
    microbatch_shape: tuple[int, ...]
    # an input that does not lead with the batch (fxshard.capture.rows): the boolean input whose True positions its
    # entries follow (a dp rank or microbatch takes its rows' entries), or whole (never split)
    counted_by: str = ""
    whole: bool = False

    def to_json(self) -> dict:
        """As every record, without ``counted_by`` and ``whole`` where they hold their defaults: the manifest of a
        batch whose inputs all lead with it reads as before they existed."""
        data = super().to_json()
        return {k: v for k, v in data.items() if not (k in ("counted_by", "whole") and not v)}


@dataclass(frozen=True)
class Mesh(_Record):
    axes: tuple[str, ...]  # outermost first
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightsSource(_Record):
    """``--weights DIR`` (``dir`` None: compiled on meta tensors without weights)."""

    dir: str | None
    files: dict[str, str]  # checkpoint tensor name -> absolute file


@dataclass(frozen=True)
class CheckpointPiece(_Record):
    """One checkpoint tensor inside a tensor built from several (an expert's ``gate_proj`` inside ``gate_up_proj``):
    it fills ``start[d]:start[d] + shape`` of each dimension of the built tensor but ``stack``, where it is the
    single index ``start[stack]``."""

    name: str
    file: str
    shape: tuple[int, ...]  # its own, as the checkpoint holds it
    start: tuple[int, ...]  # in the built tensor
    stack: int


@dataclass(frozen=True)
class CheckpointRef(_Record):
    """Where a tensor the weights shard does not hold is read from at run time: one checkpoint tensor, or (``pieces``)
    the model's name for a tensor transformers builds from several (hub checkpoints store experts one by one)."""

    name: str  # tensor name in the checkpoint, or the model's name when built from pieces
    file: str | None  # None when built from pieces
    pieces: tuple[CheckpointPiece, ...] = ()

    def to_json(self) -> dict:
        data = {"name": self.name, "file": self.file}
        if self.pieces:  # written only when built: manifests of plain checkpoints stay byte for byte
            data["pieces"] = [p.to_json() for p in self.pieces]
        return data

    @classmethod
    def from_json(cls, data: dict) -> CheckpointRef:
        return cls(data["name"], data["file"], tuple(CheckpointPiece.from_json(p) for p in data.get("pieces", ())))


@dataclass(frozen=True)
class TensorEntry:
    """A parameter, buffer or constant one rank holds: its source tensor, its placement per mesh axis, and its slice."""

    source: str  # FQN in the model
    kind: str  # parameter, buffer or constant
    persistent: bool
    # per mesh axis the compiler splits over: tp always; ep too for the experts of a MoE layer under --ep, cp next
    placements: dict[str, Placement]
    global_shape: tuple[int, ...]
    shape: tuple[int, ...]  # as this rank holds it
    dtype: str
    slice: SliceSpec  # of the axis it is split over (``axis``)
    aliases: tuple[str, ...] = ()  # the other names of a tied weight
    in_shard: bool = True  # False: read at run time from ``checkpoint`` (--weights), or nowhere (--meta)
    checkpoint: CheckpointRef | None = None

    @property
    def axis(self) -> str:
        """The mesh axis the tensor is split over (its ``slice`` is of it): the one its placements shard it over, else
        tp (``ep`` for a MoE layer's experts under ``--ep``)."""
        return next((a for a, p in self.placements.items() if isinstance(p, Shard)), TP)

    @property
    def placement(self) -> Placement:
        """Its placement over :attr:`axis`."""
        return self.placements.get(self.axis, Replicate())

    def to_json(self) -> dict:
        data = {"source": self.source, "kind": self.kind, "persistent": self.persistent,
                "placements": {axis: p.to_json() for axis, p in self.placements.items()},
                "global_shape": list(self.global_shape), "shape": list(self.shape), "dtype": self.dtype,
                "slice": self.slice.to_json(), "aliases": list(self.aliases)}
        if not self.in_shard:
            data["checkpoint"] = self.checkpoint.to_json() if self.checkpoint is not None else None
        return data

    @classmethod
    def from_json(cls, data: dict) -> TensorEntry:
        ref = data.get("checkpoint")
        return cls(source=data["source"], kind=data["kind"], persistent=data["persistent"],
                   placements={axis: placement_from_json(p) for axis, p in data["placements"].items()},
                   global_shape=tuple(data["global_shape"]), shape=tuple(data["shape"]),
                   dtype=data["dtype"], slice=SliceSpec.from_json(data["slice"]),
                   aliases=tuple(data.get("aliases", ())), in_shard="checkpoint" not in data,
                   checkpoint=CheckpointRef.from_json(ref) if ref is not None else None)


@dataclass(frozen=True)
class CollectiveEntry:
    """One ``rt.*`` collective line of a rank file, as the compiler emitted it."""

    op: str  # the rt function: all_reduce, all_gather, copy_to, scatter
    group: str  # mesh axis
    value: str  # the variable the line assigns
    shape: tuple[int, ...]  # its input as this rank holds it
    dtype: str
    backward: str | None  # what its backward issues ("all_reduce + all_gather": in that order)
    outputs_only: bool = False  # only returning the model's other outputs needs it (training skips it)
    stage: int | None = None  # the pipeline stage whose class holds the line

    def to_json(self) -> dict:
        data = {"op": self.op, "group": self.group, "value": self.value, "shape": list(self.shape),
                "dtype": self.dtype, "backward": self.backward}
        if self.outputs_only:
            data["outputs_only"] = True
        if self.stage is not None:
            data["stage"] = self.stage
        return data

    @classmethod
    def from_json(cls, data: dict) -> CollectiveEntry:
        return cls(data["op"], data["group"], data["value"], tuple(data["shape"]), data["dtype"], data["backward"],
                   bool(data.get("outputs_only", False)), data.get("stage"))


@dataclass(frozen=True)
class StageValue(_Record):
    """A tensor a pipeline stage receives or sends per microbatch."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


@dataclass(frozen=True)
class StageEntry:
    """A pipeline stage a rank file holds: its class and what it receives and sends."""

    index: int
    class_name: str  # JSON "class"
    inputs: tuple[StageValue, ...]
    outputs: tuple[StageValue, ...]

    def to_json(self) -> dict:
        return {"index": self.index, "class": self.class_name, "inputs": [v.to_json() for v in self.inputs],
                "outputs": [v.to_json() for v in self.outputs]}

    @classmethod
    def from_json(cls, data: dict) -> StageEntry:
        return cls(data["index"], data["class"], tuple(map(StageValue.from_json, data["inputs"])),
                   tuple(map(StageValue.from_json, data["outputs"])))


@dataclass(frozen=True)
class RankEntry:
    """One rank file: the (pp, tp) coordinate it runs at, on which global ranks, and what it holds and issues."""

    coords: Coords  # dp=0: every dp replica runs the same file (under --ep, with its ep rank's experts)
    global_ranks: tuple[int, ...]
    file: str
    weights: str  # its safetensors shard
    tensors: dict[str, TensorEntry]  # by key in the shard ("attr", or "StageN.attr" under pipelining)
    collectives: tuple[CollectiveEntry, ...]
    stages: tuple[StageEntry, ...] | None = None  # pipeline parallelism only

    @property
    def read_at_run_time(self) -> dict[str, tuple[int, ...]]:
        """Key -> shape of the tensors the shard does not hold (read from the ``--weights`` folder)."""
        return {k: t.shape for k, t in self.tensors.items() if not t.in_shard}

    def to_json(self) -> dict:
        data = {"coords": self.coords.to_json(), "global_ranks": list(self.global_ranks), "file": self.file,
                "weights": self.weights, "tensors": {k: t.to_json() for k, t in self.tensors.items()},
                "collectives": [c.to_json() for c in self.collectives]}
        if self.stages is not None:
            data["stages"] = [s.to_json() for s in self.stages]
        return data

    @classmethod
    def from_json(cls, data: dict) -> RankEntry:
        stages = data.get("stages")
        return cls(Coords.from_json(data["coords"]), tuple(data["global_ranks"]), data["file"], data["weights"],
                   {k: TensorEntry.from_json(t) for k, t in data.get("tensors", {}).items()},
                   tuple(map(CollectiveEntry.from_json, data.get("collectives", ()))),
                   tuple(map(StageEntry.from_json, stages)) if stages is not None else None)


@dataclass(frozen=True)
class StageRow(_Record):
    """A row of the pipeline cut's table: what a stage holds and costs."""

    stage: int
    pp_rank: int
    holds: str
    blocks: int
    flops: int  # per microbatch
    param_bytes: int
    local_param_bytes: int  # per tp rank


@dataclass(frozen=True)
class TiedWeight(_Record):
    """A weight several pipeline stages hold, its gradient summed between them after backward."""

    name: str  # the process group's name, "tied:<fqn>"
    fqn: str
    stages: tuple[int, ...]


@dataclass(frozen=True)
class PipelineInfo:
    stages: int
    stages_per_rank: int
    microbatches: int
    batch: int | None  # examples per step
    cut: str  # where the cut came from: auto, markers, split_before
    table: tuple[StageRow, ...]
    tied: tuple[TiedWeight, ...]

    def to_json(self) -> dict:
        return {"stages": self.stages, "stages_per_rank": self.stages_per_rank, "microbatches": self.microbatches,
                "batch": self.batch, "cut": self.cut, "table": [r.to_json() for r in self.table],
                "tied": [t.to_json() for t in self.tied]}

    @classmethod
    def from_json(cls, data: dict) -> PipelineInfo:
        return cls(data["stages"], data["stages_per_rank"], data["microbatches"], data["batch"], data["cut"],
                   tuple(map(StageRow.from_json, data["table"])), tuple(map(TiedWeight.from_json, data["tied"])))


@dataclass(frozen=True)
class Manifest:
    """What one compile wrote into its folder, and for which layout."""

    fxshard_version: str
    model_file: str  # the copy of the model file in the folder
    model_name: str  # the model file's own name
    model_digest: str
    model_class: str
    seed: int
    layout: Layout
    mesh: Mesh
    plan_source: str
    plan: tuple[str, ...]
    notes: tuple[str, ...]
    inputs: tuple[InputEntry, ...]
    outputs: tuple[str, ...]
    tied: dict[str, str]  # alias -> the FQN kept
    custom_ops: dict[str, str] = field(default_factory=dict)  # op -> module the rank files import for it (fxshard_fn::
    # ops: the module of the autograd.Function the rank files define the op from)
    ranks: tuple[RankEntry, ...] = ()
    pipeline: PipelineInfo | None = None
    weights: WeightsSource | None = None  # --weights DIR, or --meta
    digests: dict[str, str] | None = None  # generated file -> sha256, once written
    # passes/batch_norm_sync.py: ops mixing the examples of the batch ("FQN: op (what)"), which --grad-accum refuses
    batch_couplings: tuple[str, ...] = ()
    # peft's LoRA layers (their wrappers' FQNs): checkpoints then hold the adapters alone (fxshard/train/checkpoint.py)
    lora: tuple[str, ...] = ()

    @property
    def tied_across_stages(self) -> tuple[TiedWeight, ...]:
        """The weights several pipeline stages hold (none without pipeline parallelism)."""
        return self.pipeline.tied if self.pipeline is not None else ()

    def rank(self, coords: Coords) -> RankEntry:
        """The rank file of mesh coordinates ``coords`` (its dp coordinate aside, but for the experts it picks)."""
        for entry in self.ranks:
            if (entry.coords.pp, entry.coords.tp) == (coords.pp, coords.tp) and (
                    entry.coords.ep is None or entry.coords.ep == self.layout.ep_rank(coords.dp)):
                return entry
        raise OutputFolderError(f"no rank file for coordinates {coords} in the manifest; recompile")

    def to_json(self) -> dict:
        data = {"format": FORMAT, "fxshard_version": self.fxshard_version, "model_file": self.model_file,
                "model_name": self.model_name, "model_digest": self.model_digest, "model_class": self.model_class,
                "seed": self.seed, "layout": self.layout.to_json(), "mesh": self.mesh.to_json(),
                "plan_source": self.plan_source, "plan": list(self.plan), "notes": list(self.notes),
                "inputs": [i.to_json() for i in self.inputs], "outputs": list(self.outputs), "tied": self.tied,
                "custom_ops": self.custom_ops, "ranks": [r.to_json() for r in self.ranks]}
        for key in ("pipeline", "weights"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key).to_json()
        if self.digests is not None:
            data["digests"] = self.digests
        if self.batch_couplings:  # written only where there are some: other manifests stay as they were
            data["batch_couplings"] = list(self.batch_couplings)
        if self.lora:
            data["lora"] = list(self.lora)
        return data

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        """The manifest of a JSON object of format 1 (keys later fxshards added may be missing)."""
        pipeline, weights, digests = data.get("pipeline"), data.get("weights"), data.get("digests")
        return cls(
            fxshard_version=data["fxshard_version"], model_file=data["model_file"],
            model_name=data.get("model_name"), model_digest=data.get("model_digest"),
            model_class=data["model_class"], seed=data.get("seed", 0), layout=Layout.from_json(data["layout"]),
            mesh=Mesh.from_json(data["mesh"]) if "mesh" in data else Mesh((), ()),
            plan_source=data["plan_source"], plan=tuple(data["plan"]), notes=tuple(data.get("notes", ())),
            inputs=tuple(map(InputEntry.from_json, data["inputs"])), outputs=tuple(data["outputs"]),
            tied=data["tied"], custom_ops=data.get("custom_ops", {}),
            ranks=tuple(map(RankEntry.from_json, data["ranks"])),
            pipeline=PipelineInfo.from_json(pipeline) if pipeline is not None else None,
            weights=WeightsSource.from_json(weights) if weights is not None else None,
            digests=digests if isinstance(digests, dict) else None,
            batch_couplings=tuple(data.get("batch_couplings", ())), lora=tuple(data.get("lora", ())))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    def write(self, folder: Path) -> None:
        """Into a compile's staging folder (:mod:`fxshard.files.staged`), last: it lists what the folder holds."""
        from fxshard.files import STAGE, write_text

        write_text(Path(folder) / MANIFEST, self.dumps(), "the manifest", owner=STAGE)


# ---------------------------------------------------------------- reading and validating a folder


def read_manifest(out: str | Path) -> Manifest:
    """The manifest of an fxshard output folder, after checking the folder is one."""
    out = Path(out)
    path = out / MANIFEST
    if not out.is_dir():
        raise OutputFolderError(f"{out}: no such folder; compile first with `fxshard compile MODEL.py --out {out}`")
    if not path.is_file():
        raise OutputFolderError(f"{out}: not an fxshard output folder (no {MANIFEST}); "
                                f"compile into it with `fxshard compile MODEL.py --out {out}`")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise OutputFolderError(f"{path}: not valid JSON ({e}); recompile") from e
    not_ours = f"{path}: not an fxshard manifest of format {FORMAT}; recompile with this fxshard"
    if isinstance(data, dict) and data.get("format") in READ_BEFORE:
        raise OutputFolderError(f"{path}: compiled by an older fxshard (manifest format {data['format']}; this fxshard "
                                f"reads format {FORMAT}, which records each tensor's placement per mesh axis); "
                                f"recompile with `fxshard compile MODEL.py --out {out}` (checkpoints of the old "
                                "folder resume in the new one)")
    if not isinstance(data, dict) or data.get("format") != FORMAT or "ranks" not in data:
        raise OutputFolderError(not_ours)
    try:
        manifest = Manifest.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a key missing or of another kind
        raise OutputFolderError(f"{not_ours} ({type(e).__name__}: {e})") from e
    for i, entry in enumerate(manifest.ranks):
        for key in ("file", "weights"):
            if not inside(out, getattr(entry, key), f"ranks[{i}].{key}", path).is_file():
                raise OutputFolderError(f"{out}: {getattr(entry, key)} listed in the manifest is missing; recompile")
    if not inside(out, manifest.model_file, "model_file", path).is_file():
        raise OutputFolderError(f"{out}: {manifest.model_file} (the copied model file) is missing; recompile")
    return manifest


def inside(folder: Path, name, key: str, where: Path, error: type[Exception] = OutputFolderError) -> Path:
    """``folder / name`` with symlinks resolved, refused unless it stays inside ``folder``.

    Every reader of a manifest or checkpoint index goes through here: those files are plain JSON anyone
    can edit, and a path such as ``../../etc/passwd`` must not make ``show`` print or ``run`` execute it."""
    if not isinstance(name, str) or not name:
        raise error(f"{where}: {key} is {name!r}; expected a file name relative to {folder}")
    root = Path(folder).resolve()
    path = (root / name).resolve()
    if Path(name).is_absolute() or not path.is_relative_to(root):
        raise error(f"{where}: {key} is {name!r}, which resolves to {path}, outside {folder}; a manifest or "
                    "checkpoint index may only name files inside its own folder. Recompile (or save the checkpoint "
                    "again) rather than editing its paths")
    return path


def listed_files(path: Path) -> set[str] | None:
    """Every file the manifest at ``path`` says its compile wrote (rank files, weight shards, the model copy,
    itself), or None if fxshard did not write it (format, version and rank list).

    Deliberately loose: a folder whose manifest an older fxshard wrote, or that does not fully read, is still
    fxshard's to replace, and only these few keys say so."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not (isinstance(data, dict) and data.get("format") in (FORMAT, *READ_BEFORE) and "fxshard_version" in data
            and isinstance(data.get("ranks"), list) and isinstance(data.get("model_file"), str)):
        return None
    names = {MANIFEST, data["model_file"]}
    for entry in data["ranks"]:
        names |= {entry[key] for key in ("file", "weights") if isinstance(entry.get(key), str)}
    return names


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def edited_files(out: Path, manifest: Manifest) -> list[str]:
    """The generated files (rank files, model.py) whose sha256 differs from the one recorded at compile.

    Weights are not digested: they are data (safetensors runs no code), can be many GB to hash on every
    run, and ``check`` already compares each shard's tensors and shapes with the code."""
    if manifest.digests is None:
        return ["manifest.json (it records no file digests: compiled by an older fxshard)"]
    names = [e.file for e in manifest.ranks] + [manifest.model_file]
    return [n for n in names
            if manifest.digests.get(n) != file_digest(inside(out, n, f"digests[{n!r}]", out / MANIFEST))]


def refuse_edited(out: Path, manifest: Manifest, override: str = "--allow-edited") -> None:
    """Refuse a folder whose rank files or model.py differ from what the compile wrote, before any of it runs;
    ``override`` names how the caller runs them anyway (``--allow-edited``, ``allow_edited=True``)."""
    if manifest.digests is None:
        raise OutputFolderError(f"{Path(out) / MANIFEST}: records no sha256 of the generated files (compiled by an "
                                f"older fxshard), so an edit cannot be ruled out; recompile, or pass {override} "
                                "to run the files as they are")
    edited = edited_files(Path(out), manifest)
    if edited:
        verb = "differs" if len(edited) == 1 else "differ"
        raise OutputFolderError(f"{out}: {', '.join(edited)} {verb} from what fxshard compile wrote (sha256 in "
                                f"manifest.json): edited after compile. Recompile, or pass {override} to run "
                                "the edited files anyway")


def import_rank_file(path: str | Path):
    """Import a generated rank file as a module."""
    path = Path(path).resolve()
    try:
        return import_file(path, "fxshard_rank_")
    except Exception as e:
        raise OutputFolderError(f"{path}: the rank file does not import ({type(e).__name__}: {e}); recompile") from e
