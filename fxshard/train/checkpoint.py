"""Training checkpoints that any layout can resume, and export to a Hugging Face folder.

A checkpoint is a folder ``DIR/step-00000K/`` holding, for every source parameter (by FQN; of a LoRA compile, for every
adapter: its frozen base is the compile's, :data:`FROZEN`), the trained value and its AdamW state (``exp_avg``,
``exp_avg_sq``, ``step``) as the tensor-parallel *slices* the saving layout held, dp-gathered, one safetensors file per
(pp, tp) coordinate::

    index.json                    step, model digest, layout, optimizer, {fqn: global shape + pieces}
    model.py                      a copy of the model file (what `fxshard export` builds)
    shard-pp0-tp1.safetensors     keys "fqn|kind|dim.index.parts.blocks", kind in param/exp_avg/...
    shard-pp0-tp0-ep1.safetensors under --ep: one file per ep rank, its experts' dim-0 slice (dense in ep0's)

Loading is by slice: a rank of any layout reads the pieces of each source it holds, assembles them
when its slice differs from the saved one (:func:`fxshard.runtime.slices.assemble`), and takes its own
(:func:`fxshard.runtime.slices.take`); Adam state is resharded exactly like the parameter.  Under
``--dtype bf16`` the saved value is the fp32 master weight.

Why not ``torch.distributed.checkpoint``: DCP reshards only DTensor / ShardedTensor, and the packed
q/k/v slices (``S(d)x3``) are not a DTensor placement; saving them under per-slice keys would leave
the loader to assemble them by hand anyway, and export (no process group) would need DCP's reader
for what is a plain set of safetensors files.  The layout above is readable with safetensors alone.

A save is atomic: every rank writes into ``DIR/step-00000K.tmp-<uuid>/``; after a barrier rank 0
writes the index, renames the folder to ``step-00000K`` and replaces ``DIR/latest`` (all through
:mod:`fxshard.files`).  A crash anywhere before that leaves ``latest`` on the previous complete checkpoint;
partial folders are ignored.

Every tensor's digest is in its shard's header, and every shard's size and header digest in the index
(:mod:`fxshard.train.digests`): a resume and an export hash each tensor they read and refuse one that differs.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fxshard.codegen.manifest import Manifest, RankEntry, inside
from fxshard.errors import FxshardError
from fxshard.runtime.slices import SliceSpec, assemble, take
from fxshard.train.digests import DigestError, check_tensor, digests_of, header_digest

FORMAT = "fxshard-checkpoint/1"
LATEST = "latest"
INDEX = "index.json"
STATE_KINDS = ("exp_avg", "exp_avg_sq", "step")
CRASH_ENV = "FXSHARD_TEST_CRASH_IN_SAVE"  # tests: os._exit in the middle of the save at this step
OWNER = "the checkpoint folder"  # its files are fxshard's by its index and steps (fxshard.files' owner)
# the index's record of the parameters a LoRA compile's checkpoint leaves out, its frozen base: they never change,
# so they are the compile's own (make_model() at the seed, or the --weights folder named here), read from there again
# by a resumed run and by export (docs/lora.md)
FROZEN = "frozen"


class CheckpointError(FxshardError):
    """A checkpoint folder is missing, damaged, or from another model."""


@dataclass(frozen=True)
class CheckpointConfig:
    """``fxshard run --checkpoint DIR --save-every K [--resume | --overwrite] [--keep-last N]
    [--allow-changed-model]``."""

    folder: Path
    save_every: int = 0
    resume: bool = False
    overwrite: bool = False
    keep_last: int = 0
    allow_changed_model: bool = False


def _key(fqn: str, kind: str, sl: SliceSpec) -> str:
    uneven = (f".{'-'.join(map(str, sl.sizes))}" if sl.sizes else "") + \
        (f".r{'-'.join(map(str, sl.replicas))}" if sl.replicas else "")  # a packed split of unequal blocks
    return f"{fqn}|{kind}|{sl.dim}.{sl.index}.{sl.parts}.{sl.blocks}{uneven}"


def _shard_name(coords: dict, ep_rank: int | None = None) -> str:
    """The file of (pp, tp) coordinate ``coords``; under --ep one per ep rank (the dense tensors in ep rank 0's)."""
    ep = "" if ep_rank is None else f"-ep{ep_rank}"
    return f"shard-pp{coords['pp']}-tp{coords['tp']}{ep}.safetensors"


def find_checkpoint(path: str | Path, say=None) -> Path:
    """The checkpoint folder ``path`` names: itself (it holds index.json), or ``path/latest``'s target.

    A ``latest`` naming a step with no index (a crash between the save's two renames, or a step deleted by
    hand) falls back to the newest complete ``step-*`` folder, and ``say`` is told which."""
    path = Path(path)
    if (path / INDEX).is_file():
        return path
    latest = path / LATEST
    if not latest.is_file():
        raise CheckpointError(f"{path}: no checkpoint here (neither {INDEX} nor {LATEST}); save one with "
                              "`fxshard run OUT --checkpoint DIR --save-every K`")
    name = inside(path, LATEST, "the file itself", latest, CheckpointError).read_text().strip()  # not a link out
    target = inside(path, name, "the step it names", latest, CheckpointError)
    if (target / INDEX).is_file():
        return target
    complete = _complete_steps(path)
    what = "which has no index.json (a save interrupted between its renames?)" if target.is_dir() else \
        "which does not exist"
    if not complete:
        raise CheckpointError(f"{latest} names {name}, {what}, and no other step of {path} is complete: the "
                              "checkpoint is damaged; start without --resume")
    if say is not None:
        say(f"{latest} names {name}, {what}; using {complete[-1].name}, the newest complete checkpoint")
    return complete[-1]


def _complete_steps(path: Path) -> list[Path]:
    """The ``step-*`` folders of ``path`` that hold an index (not partial ``.tmp-`` saves, nor links out)."""
    steps = []
    for p in sorted(path.glob("step-*")):
        if "." in p.name or p.is_symlink() or not (p / INDEX).is_file():
            continue
        steps.append(p)
    return steps


def read_index(path: Path) -> dict:
    """A checkpoint's index, every field fxshard reads checked (a damaged or hand-edited value is named, never a
    traceback at the first use)."""
    damaged = f"{path}: not a readable checkpoint index"
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{damaged} ({type(e).__name__}: {e}); the checkpoint is damaged") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an fxshard checkpoint index of format {FORMAT}")
    step = index.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise CheckpointError(f"{path}: step {step!r}; expected the number of steps trained (0 or more): the "
                              "checkpoint is damaged")
    tensors = index.get("tensors")
    if not isinstance(tensors, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("pieces"), list) and r["pieces"]
            and all(isinstance(p, dict) and isinstance(p.get("file"), str) and "slice" in p for p in r["pieces"])
            for r in tensors.values()):
        raise CheckpointError(f"{damaged}: expected \"tensors\" to map each parameter to its pieces (a slice and a "
                              "file each); the checkpoint is damaged")
    for key in ("trainer", "optimizer", "files"):
        if not isinstance(index.get(key) or {}, dict):
            raise CheckpointError(f"{damaged}: its {key!r} is {type(index[key]).__name__}, expected an object; the "
                                  "checkpoint is damaged")
    return index


def _check_recorded(shard: Path, recorded: dict | None) -> None:
    """A shard is the one its index was written with: its size, and the digest of its header (which holds every
    tensor's digest).  Indexes saved before fxshard recorded them skip this."""
    if recorded is None:
        return
    size = shard.stat().st_size
    if size != recorded.get("size"):
        raise CheckpointError(f"{shard}: {size} bytes, the index recorded {recorded.get('size')}; the file is not "
                              "the one saved with this checkpoint (damaged, or copied from another step)")
    try:
        found = header_digest(shard)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{shard}: its header cannot be read ({e}); the checkpoint is damaged") from None
    if found != recorded.get("header"):
        raise CheckpointError(f"{shard}: its header (tensor names, offsets, digests) differs from the one the index "
                              "recorded; the file is not the one saved with this checkpoint (damaged, or copied from "
                              "another step)")


# ---------------------------------------------------------------- save


def _optimizers(opt, dp_group, edp_group) -> dict[str, tuple]:
    """``{axis: (optimizer, group)}``: which optimizer holds the Adam state of a parameter the manifest records
    over ``axis``, and the group that state is replicated or sharded over — ``"tp"`` (every parameter without
    --ep, the dense ones with it) over dp; ``"ep"`` (this rank's experts) over edp, the ranks holding the same
    experts (:class:`fxshard.train.optim.ExpertSplitOptimizer`)."""
    from fxshard.train.optim import ExpertSplitOptimizer

    if isinstance(opt, ExpertSplitOptimizer):
        assert edp_group is not None, "an expert-parallel run's checkpoint needs its edp group"
        dense, experts = opt.parts
        return {"tp": (dense, dp_group), "ep": (experts, edp_group)}
    return {"tp": (opt, dp_group)}


def _optimizer_view(opt):
    """``view(p) -> (value, state or None, owner dp rank or None)``: where p's trained value and Adam state live.

    ``owner`` None: dp rank 0 holds them (replicated; DTensor shards gathered by ``full_tensor``; the ZeRO-1
    distributed optimizer's shards gathered here, collectively, once for all parameters)."""
    from fxshard.runtime.distributed_optimizer import DistributedOptimizer
    from fxshard.runtime.mixed_precision import MasterWeightAdamW

    if isinstance(opt, MasterWeightAdamW):
        index = {id(p): i for i, p in enumerate(opt.params)}

        def view(p):
            if id(p) not in index:  # frozen: no master, no state; its value saved in fp32 as the masters are
                return p.detach().float(), None, None
            m = opt.masters[index[id(p)]]
            return m, opt.optim.state.get(m), None
        return view
    if isinstance(opt, DistributedOptimizer):
        whole = opt.gathered_state()  # on dp rank 0; the others' values are not saved

        def sharded(p):
            got = whole.get(id(p), {})
            return got.get("param", p), (got if "exp_avg" in got else None), None
        return sharded
    return lambda p: (p, opt.state.get(p), None)


def _gathered(p, value, state, owner, dp_group) -> dict[str, torch.Tensor] | None:
    """``{kind: tensor}`` of one parameter on dp rank 0 (None on the others); collective over dp (the experts of
    an ep rank: over its edp group, whose rank 0 writes them)."""
    if owner is not None and dist.get_world_size(dp_group) > 1:
        me = dist.get_rank(dp_group)
        has = torch.tensor([0 if owner == me and not state else 1], device=p.device)
        dist.broadcast(has, group_src=owner, group=dp_group)
        out = {}
        for kind in ("param",) + (STATE_KINDS if int(has) else ()):
            if owner == me:
                t = (value if kind == "param" else state[kind]).detach().to(p.device, torch.float32).contiguous()
            else:
                t = torch.empty(() if kind == "step" else p.shape, dtype=torch.float32, device=p.device)
            dist.broadcast(t, group_src=owner, group=dp_group)
            out[kind] = t
        return out if me == 0 else None
    out = {"param": value} | {k: state[k] for k in STATE_KINDS if state}
    out = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in out.items()}
    return out if dist.get_rank(dp_group) == 0 else None


def save_checkpoint(folder: Path, step: int, out: Path, held: dict, entry: RankEntry, opt, manifest: Manifest,
                    coords: dict, dp_group, optim_config, edp_group=None, trainer: dict | None = None,
                    keep_last: int = 0, replace: bool = False) -> Path | None:
    """Save this rank's part of a checkpoint at ``step`` (collective over all ranks); rank 0 returns its path.
    ``trainer`` (rank 0's, JSON): where training is beyond the tensors (batches trained, the LR scheduler's state, the
    data position), kept in the index as ``"trainer"``.  Once the step is complete, ``keep_last`` and ``replace``
    delete older steps (:func:`_prune`).

    Each distinct slice is written once (under --cp by cp rank 0: the cp ranks hold the same parameters, and their
    optimizer state is sharded or replicated over dp x cp, the group ``dp_group`` names then): the dense tensors by
    dp rank 0, and under --ep each ep rank's experts
    (its E/ep of the stacked expert weights, a dim-0 slice) by the first rank of its edp group (dp coordinate
    ``d < ep``), into that ep rank's file, so the global tensor is the concatenation of the ep slices.

    A write that fails (a folder made unwritable, a full disk) fails the save on every rank alike, with a
    :class:`CheckpointError` naming the rank and the path: the ranks agree after each stage of the save, so none
    waits for one that stopped, and ``latest`` keeps naming the last complete checkpoint."""
    folder = Path(folder)
    rank = dist.get_rank()
    name = f"step-{step:08d}.tmp-{uuid.uuid4().hex[:8]}"
    made = [name, _attempt(lambda: (folder / name).mkdir(parents=True), folder / name) if rank == 0 else None]
    dist.broadcast_object_list(made, src=0)  # one temporary folder for all ranks, or rank 0's failure to make it
    tmp = folder / made[0]
    _agree(step, folder, [made[1]])
    views = {axis: (_optimizer_view(o), group) for axis, (o, group) in _optimizers(opt, dp_group, edp_group).items()}
    tensors, frozen = {}, set()
    for prefix, module in held.items():
        for pname, p in module.named_parameters():
            t = entry.tensors[prefix + pname]
            if manifest.lora and not p.requires_grad:  # a LoRA base: the compile's weights hold it (FROZEN)
                frozen.add(t.source)
                continue
            view, group = views[t.axis]
            got = _gathered(p, *view(p), group)
            if got is not None:
                tensors |= {_key(t.source, k, t.slice): v.detach().cpu().contiguous() for k, v in got.items()}
    layout = manifest.layout
    failed = None
    # dp rank 0 (under --ep the first rank of each edp group) of cp rank 0: the cp ranks hold the same parameters
    if coords["dp"] < layout.ep and not _cp_index(coords):
        shard = tmp / _shard_name(coords, layout.ep_rank(coords["dp"]) if layout.ep > 1 else None)
        failed = _attempt(lambda: _write_shard(shard, tensors), shard)
    if os.environ.get(CRASH_ENV) == str(step) and rank == 0:
        os._exit(17)  # a kill in the middle of the save: some shards written, no index, no rename
    _agree(step, folder, _gather(failed), tmp)
    if manifest.lora:  # every stage's bases, named in the index
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, sorted(frozen))
        frozen = {fqn for names in found for fqn in names}
    committed = None
    if rank == 0:
        committed = _attempt(lambda: _commit(folder, tmp, step, Path(out), manifest, optim_config, trainer, frozen),
                             folder)
    _agree(step, folder, _gather(committed), tmp)
    if rank == 0:
        _prune(folder, folder / f"step-{step:08d}", keep_last, replace)
    return folder / f"step-{step:08d}" if rank == 0 else None


def _write_shard(shard: Path, tensors: dict) -> None:
    """One shard file, each tensor's digest in its header; on disk before the index says the checkpoint is complete."""
    from safetensors.torch import save_file

    from fxshard.files import path_for_library
    from fxshard.train.digests import shard_metadata, tensor_digests

    metadata = shard_metadata(tensor_digests(tensors))
    with path_for_library(shard, "a checkpoint shard", fsync=True, owner=OWNER) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def _cp_index(coords) -> int:
    """The cp coordinate of ``coords`` (a :class:`~fxshard.ir.layout.Coords` or its JSON), 0 without ``--cp``."""
    cp = coords.get("cp") if isinstance(coords, dict) else coords.cp
    return cp or 0


def _attempt(write, path: Path) -> str | None:
    """Run ``write``; None, or what failed: this rank, the path, the system's reason."""
    try:
        write()
    except OSError as e:
        where = e.filename or path
        return f"rank {dist.get_rank()} could not write {where} ({e.strerror or e})"
    return None


def _gather(failed: str | None) -> list:
    """Every rank's ``failed``, on every rank (a barrier that carries each rank's outcome)."""
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, failed)
    return found


def _agree(step: int, folder: Path, failures: list, tmp: Path | None = None) -> None:
    """Raise the same :class:`CheckpointError` on every rank when any rank's part of the save failed."""
    failures = [f for f in failures if f]
    if not failures:
        return
    if tmp is not None and dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save: never loaded; dropped where it can be
    raise CheckpointError(f"the checkpoint of step {step} could not be saved: {'; '.join(failures)}. The run stops; "
                          f"{folder / LATEST} still names the last complete checkpoint. Make {folder} writable (or "
                          "free space), then continue with --resume, or save to another --checkpoint folder")


def _commit(folder: Path, tmp: Path, step: int, out: Path, manifest: Manifest, optim_config, trainer=None,
            frozen: set[str] = frozenset()) -> None:
    """Rank 0, after every shard is written: index, model file, rename, then ``latest``.  ``frozen``: the parameters
    left out (a LoRA compile's bases), listed under :data:`FROZEN` with where they are read from."""
    from dataclasses import asdict

    pieces: dict[str, dict] = {}
    ep = manifest.layout.ep > 1
    for e in manifest.ranks:
        for t in e.tensors.values():
            if t.kind != "parameter" or t.source in frozen:
                continue
            rec = pieces.setdefault(t.source, {"global_shape": list(t.global_shape), "dtype": t.dtype,
                                               "aliases": list(t.aliases), "pieces": []})
            if all(p["slice"] != t.slice.to_json() for p in rec["pieces"]):
                file = _shard_name(e.coords, (e.coords["ep"] if t.axis == "ep" else 0) if ep else None)
                rec["pieces"].append({"slice": t.slice.to_json(), "file": file})
    from fxshard.files import publish_folder, write_bytes
    from fxshard.train.digests import HASH

    files = {name: {"size": (tmp / name).stat().st_size, "header": header_digest(tmp / name)}
             for name in sorted({p["file"] for rec in pieces.values() for p in rec["pieces"]})}
    index = {"format": FORMAT, "step": step, "model_file": manifest.model_file,
             "model_name": manifest.model_name, "model_digest": manifest.model_digest,
             "seed": manifest.seed, "layout": manifest.layout.to_json(), "optimizer": asdict(optim_config),
             "tensors": pieces, "digest": HASH, "files": files} | ({"trainer": trainer} if trainer is not None else {})
    if frozen:
        weights = manifest.weights.dir if manifest.weights is not None else None
        aliases = {a for e in manifest.ranks for t in e.tensors.values() if t.source in frozen for a in t.aliases}
        index[FROZEN] = {"tensors": sorted(frozen | aliases), "weights": weights}
    write_bytes(tmp / "model.py", (out / manifest.model_file).read_bytes(), "the checkpoint's model file", owner=OWNER)
    _write_atomic(tmp / INDEX, json.dumps(index, indent=1))
    final = folder / f"step-{step:08d}"
    publish_folder(tmp, final)
    _write_atomic(folder / LATEST, final.name + "\n")
    for stale in folder.glob("step-*.tmp-*"):  # partial saves of killed runs: never loaded, now dropped
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _prune(folder: Path, final: Path, keep_last: int, replace: bool) -> None:
    """Rank 0, once ``final`` is complete and ``latest`` names it: with ``replace`` (``--overwrite``'s first save)
    delete every other complete step (an earlier run's), and with ``keep_last`` all but the newest N.  Only complete
    steps are deleted, never ``final``; a step is renamed out of the ``step-*`` names first, so a deletion cut short
    leaves no step that looks complete.  (A step being written is a ``.tmp-`` folder of the run holding the lock.)"""
    others = [p for p in _complete_steps(folder) if p != final]
    if replace:
        drop = others
    elif keep_last:
        drop = others[:max(0, len(others) + 1 - keep_last)]  # by step number: the newest N include final
    else:
        return
    from fxshard.files import remove_folder

    for step in drop:
        try:
            remove_folder(step)
        except OSError as e:  # the save is complete: a step that stays is no reason to stop training
            from fxshard.errors import warn

            warn(f"{step}: could not be deleted ({e.strerror or e}); it stays")


def _write_atomic(path: Path, text: str) -> None:
    from fxshard.files import write_text

    write_text(path, text, f"the checkpoint's {path.name}", fsync=True, owner=OWNER)


# ---------------------------------------------------------------- load


class CheckpointReader:
    """Global or sliced tensors of a checkpoint, read piece by piece from its shard files::

        reader = CheckpointReader("ckpt")            # follows ckpt/latest
        w = reader.tensor("lm_head.weight")          # the full trained weight
        m = reader.tensor("lm_head.weight", "exp_avg", SliceSpec(0, 1, 4))   # rank 1 of 4's slice
    """

    def __init__(self, path: str | Path):
        self.path = find_checkpoint(path)
        self.index = read_index(self.path / INDEX)
        self.step = self.index["step"]
        self._files: dict[str, object] = {}
        self._digests: dict[str, dict | None] = {}
        # tied weights are saved once, under the manifest's source name; their other names lead to it
        self.aliases = {a: fqn for fqn, rec in self.sources.items() for a in rec.get("aliases", [])}
        self.frozen = set((self.index.get(FROZEN) or {}).get("tensors", []))  # not saved: the compile's values

    @property
    def sources(self) -> dict[str, dict]:
        return self.index["tensors"]

    def _open(self, name: str):
        if name not in self._files:
            from safetensors import safe_open

            path = inside(self.path, name, "a tensor piece's file", self.path / INDEX, CheckpointError)
            if not path.is_file():
                raise CheckpointError(f"{path}: shard file missing from the checkpoint")
            _check_recorded(path, (self.index.get("files") or {}).get(name))
            f = safe_open(str(path), framework="pt")
            self._digests[name] = digests_of(f.metadata(), str(path))
            self._files[name] = f
        return self._files[name]

    def has_state(self, fqn: str) -> bool:
        fqn = self.canonical(fqn)
        piece = self._record(fqn)["pieces"][0]
        return _key(fqn, "exp_avg", SliceSpec.from_json(piece["slice"])) in self._open(piece["file"]).keys()

    def canonical(self, fqn: str) -> str:
        """The name ``fqn`` is saved under (itself, or the source of the tied weight it is an alias of)."""
        return fqn if fqn in self.sources else self.aliases.get(fqn, fqn)

    def _record(self, fqn: str) -> dict:
        if fqn not in self.sources:
            raise CheckpointError(f"{self.path / INDEX}: tensor {fqn} is missing from the checkpoint "
                                  f"(it holds {len(self.sources)} tensors, e.g. {sorted(self.sources)[:3]})")
        return self.sources[fqn]

    def _piece(self, fqn: str, kind: str, piece: dict) -> torch.Tensor:
        key = _key(fqn, kind, SliceSpec.from_json(piece["slice"]))
        f = self._open(piece["file"])
        if key not in f.keys():
            raise CheckpointError(f"{self.path / piece['file']}: tensor {fqn} ({kind}, key {key!r}) is missing; "
                                  "the checkpoint is damaged — resume from an earlier one")
        digests = self._digests[piece["file"]]
        if digests is None:  # saved before fxshard recorded digests
            return f.get_tensor(key)
        try:
            return check_tensor(f.get_tensor(key), digests.get(key), str(self.path / piece["file"]), key)
        except DigestError as e:
            raise CheckpointError(str(e)) from None

    def tensor(self, fqn: str, kind: str = "param", sl: SliceSpec | None = None) -> torch.Tensor:
        """``fqn``'s ``kind`` tensor, whole, or the part ``sl`` describes."""
        fqn = self.canonical(fqn)
        rec = self._record(fqn)
        if kind == "step":
            return self._piece(fqn, kind, rec["pieces"][0])
        sl = sl or SliceSpec()
        for piece in rec["pieces"]:
            if SliceSpec.from_json(piece["slice"]) == sl:  # the same slice as saved: read it as it is
                return self._piece(fqn, kind, piece)
        full = assemble([(SliceSpec.from_json(p["slice"]), self._piece(fqn, kind, p)) for p in rec["pieces"]],
                        rec["global_shape"])
        return take(full, sl).contiguous()

    def check_model(self, manifest: Manifest, out: Path, allow_changed: bool = False) -> None:
        """Raise unless this checkpoint was saved from the model ``manifest`` compiles (the model file's digest;
        ``allow_changed``: any model) and ``manifest``'s parameters (sources and global shapes) are all in it."""
        saved = self.index.get("model_digest")
        if not allow_changed and saved and manifest.model_digest and saved != manifest.model_digest:
            raise CheckpointError(
                f"{self.path}: saved from another model file ({self.index.get('model_name')}, digest {saved}) than "
                f"{out} was compiled from ({manifest.model_name}, digest {manifest.model_digest}): the model changed "
                "since the checkpoint, even if its parameters still fit (an activation, a norm, a constant). Resume "
                "with the model it was trained from, or pass --allow-changed-model to continue it with this one")
        want = {t.source: list(t.global_shape) for e in manifest.ranks for t in e.tensors.values()
                if t.kind == "parameter"}
        want = {self.canonical(f): shape for f, shape in want.items() if f not in self.frozen}
        missing = sorted(set(want) - set(self.sources))
        wrong = sorted(f for f in set(want) & set(self.sources) if want[f] != self.sources[f]["global_shape"])
        if not missing and not wrong:
            return
        same = manifest.model_digest == self.index.get("model_digest")
        detail = (f"tensor {missing[0]} is missing from the checkpoint" if missing else
                  f"tensor {wrong[0]} has shape {self.sources[wrong[0]]['global_shape']} in the checkpoint, "
                  f"{want[wrong[0]]} in the model")
        if same:
            raise CheckpointError(f"{self.path / INDEX}: {detail}; the checkpoint is damaged")
        raise CheckpointError(
            f"{self.path}: saved from a different model ({self.index.get('model_name')}, digest "
            f"{self.index.get('model_digest')}) than {out} compiles ({manifest.model_name}, digest "
            f"{manifest.model_digest}): {detail} ({len(missing)} missing, {len(wrong)} of another shape); "
            "resume with the model the checkpoint was trained from")
