"""Weight shards: each rank's slices of the compiled tensors (:func:`weight_shards`), or, with ``--weights DIR``,
references into a Hugging Face folder, validated at compile time and read by slice at run time.

With ``--weights`` the model is built and captured with its parameters on the meta device, so a
70B-shaped configuration compiles in a few hundred MB.  No parameter shard is written: every rank's
manifest entry names the checkpoint tensor and the slice it holds, and at run time the rank reads
only that slice (:mod:`fxshard.runtime.slices`).  Everything that can be checked without reading
tensor data is checked here, from the safetensors headers and ``config.json``::

    source = checkpoint_source("ckpt/", program)   # raises WeightsError naming file and tensor
    source.files["model.layers.0.mlp.up_proj.weight"]  # -> "/abs/ckpt/model-00001-of-00002.safetensors"
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from fxshard.capture.lora import base_name, peft_base
from fxshard.capture.program import Program
from fxshard.codegen.hub_layout import Piece, hub_names, hub_sources
from fxshard.codegen.manifest import CheckpointPiece, CheckpointRef, Manifest, WeightsSource
from fxshard.errors import WeightsError, warn
from fxshard.runtime.slices import take

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# configuration entries that fix tensor shapes, under the names Llama-like and GPT-2-like configs use
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "n_embd", "n_layer", "n_head", "n_inner",
              "n_positions", "max_position_embeddings", "tie_word_embeddings")
FIX = "point --weights at the folder this model's configuration came from, or build make_model() from " \
      "that folder's config (transformers.AutoConfig.from_pretrained(DIR))"


@dataclass
class CheckpointSource:
    dir: Path
    names: dict[str, str]  # state fqn in the program -> tensor name in the checkpoint (the fqn itself when built)
    files: dict[str, str]  # checkpoint tensor name -> absolute file path
    # state fqn -> (piece, its shape): the tensors transformers builds from several (hub experts, one tensor each)
    pieces: dict[str, tuple[Piece, ...]] = field(default_factory=dict)

    def record(self) -> WeightsSource:
        """The manifest's ``weights`` section: the folder and, by tensor name, the file each rank reads."""
        return WeightsSource(str(self.dir), dict(sorted(self.files.items())))

    def ref(self, fqn: str) -> CheckpointRef:
        """The manifest's record of where ``fqn`` is read from."""
        if fqn not in self.pieces:
            name = self.names[fqn]
            return CheckpointRef(name, self.files[name])
        return CheckpointRef(fqn, None, tuple(CheckpointPiece(p.name, self.files[p.name], p.shape, p.start, p.stack)
                                              for p in self.pieces[fqn]))


def tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    if not folder.is_dir():
        raise WeightsError(f"{folder}: no such folder; --weights expects a Hugging Face model folder "
                           f"({SINGLE} or {INDEX} next to config.json)")
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a safetensors index (no weight_map: {e}); re-save the checkpoint "
                               "with save_pretrained") from e
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: weight_map is {type(weight_map).__name__}, expected a mapping of tensor "
                               "names to file names; re-save the checkpoint with save_pretrained")
        return {name: _in_folder(folder, file, name, index) for name, file in weight_map.items()}
    single = folder / SINGLE
    if not single.is_file():
        raise WeightsError(f"{folder}: holds neither {SINGLE} nor {INDEX}; --weights expects a Hugging Face "
                           "model folder saved with save_pretrained (safetensors)")
    return {name: single for name in _header(single, "(any)")}


def _in_folder(folder: Path, file, name: str, index: Path) -> Path:
    """An index's file for tensor ``name``, refused unless it names a file inside ``folder``: every rank would read
    it at run time, whatever the index says.  The name is judged as written (no ``..``, not absolute); a link
    the folder itself holds is the folder's own (the Hugging Face cache links its snapshot files to blobs/)."""
    if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
        raise WeightsError(f"{index}: weight_map names {file!r} for tensor {name}, which is not a file inside "
                           f"{folder}; a Hugging Face index names files inside its own folder. Re-save the checkpoint "
                           "with save_pretrained, or fix the index")
    return folder / file


def checkpoint_source(folder: str | Path, program: Program) -> CheckpointSource:
    """Check ``folder`` holds every parameter of ``program`` with its shape; map each to its file.

    Raises :class:`WeightsError` for a configuration of another model, a tensor missing from the
    checkpoint, a shape or kind of dtype that disagrees, or a file that does not read (truncated)."""
    folder = Path(folder).resolve()
    files = tensor_files(folder)
    _check_config(folder, program)
    # a peft model's base is read by the base model's own names (base_name), its adapters not at all
    wanted = {base_name(s.fqn): tuple(program.tensors[s.fqn].shape) for s in program.state
              if s.kind != "constant" and base_name(s.fqn) is not None}
    try:
        built = hub_names(peft_base(program.model)[0], files, wanted)
    except WeightsError as e:
        raise WeightsError(f"{folder}: {e}") from None
    names, pieces = {}, {}
    for spec in program.state:
        if spec.kind == "constant" or base_name(spec.fqn) is None:
            continue  # a LoRA adapter (--lora): drawn at compile time, written with the rank shards
        name = _checkpoint_name(spec.fqn, program, files) or _checkpoint_name(spec.fqn, program, built)
        if name is None:
            if spec.kind == "buffer":
                continue  # not saved (rotary tables, masks): the compiled value is used
            hub = hub_sources(program.model, spec.fqn)
            also = (f", neither stacked nor one tensor per expert as transformers' table reads it "
                    f"({', '.join(map(repr, hub))})") if hub else ""
            raise WeightsError(f"{folder}: tensor {spec.fqn} is missing from the checkpoint{also} "
                               f"({len(files)} tensors in {_file_list(files)}); the model needs it — {FIX}")
        found = name if name in files else built[name]
        if isinstance(found, tuple):
            names[spec.fqn] = spec.fqn
            pieces[spec.fqn] = found
        else:
            names[spec.fqn] = found
    headers: dict[Path, dict] = {}

    def header(name: str) -> tuple[Path, list[int], str]:
        path = files[name]
        if path not in headers:
            headers[path] = _header(path, name)
        if name not in headers[path]:
            raise WeightsError(f"{path}: the index names it for tensor {name}, but the file does not hold it; "
                               "re-save the checkpoint")
        return path, *headers[path][name]

    for fqn, name in names.items():
        expected = program.tensors[fqn]
        if fqn in pieces:
            for piece in pieces[fqn]:
                _check_piece(piece, header(piece.name), fqn, expected)
            continue
        path, shape, dtype = header(name)
        if tuple(shape) != tuple(expected.shape):
            raise WeightsError(f"{path}: tensor {name} has shape {list(shape)}, the model (its config) expects "
                               f"{list(expected.shape)} for {fqn}; {FIX}")
        _check_kind(path, name, dtype, fqn, expected)
    used = {p.name for built_pieces in pieces.values() for p in built_pieces} | {
        n for f, n in names.items() if f not in pieces}
    return CheckpointSource(folder, names, {n: str(files[n]) for n in sorted(used)}, pieces)


def _check_piece(piece: Piece, found: tuple[Path, list[int], str], fqn: str, expected: torch.Tensor) -> None:
    """A piece's shape is its share of the built tensor (an expert's gate: ``[I, H]`` of
    ``gate_up_proj [E, 2I, H]``)."""
    path, shape, dtype = found
    if tuple(shape) != piece.shape:
        raise WeightsError(f"{path}: tensor {piece.name} has shape {list(shape)}, the model (its config) expects "
                           f"{list(piece.shape)} for it (at {list(piece.start)} of {fqn} {list(expected.shape)}); "
                           f"{FIX}")
    _check_kind(path, piece.name, dtype, fqn, expected)


def _check_kind(path: Path, name: str, dtype: str, fqn: str, expected: torch.Tensor) -> None:
    if _is_float(dtype) != expected.is_floating_point():
        raise WeightsError(f"{path}: tensor {name} has dtype {dtype}, the model expects "
                           f"{str(expected.dtype).removeprefix('torch.')} for {fqn}; {FIX}")


def _checkpoint_name(fqn: str, program: Program, files: dict) -> str | None:
    """``fqn`` or a name tied to it (a tied ``lm_head.weight`` is saved once, as the embedding)."""
    kept = program.tied.get(fqn, fqn)
    candidates = [fqn, kept] + sorted(a for a, k in program.tied.items() if k == kept)
    candidates += [base_name(c) for c in candidates]  # a peft model's base, by the base model's own names
    return next((c for c in candidates if c in files), None)


def _header(path: Path, wanted: str) -> dict[str, tuple[list[int], str]]:
    """Tensor name -> (shape, safetensors dtype) from the file's header; reads no tensor data."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    except FileNotFoundError as e:
        raise WeightsError(f"{path}: missing (needed for tensor {wanted}); the checkpoint folder is incomplete") from e
    except Exception as e:  # safetensors checks the header against the file size: a truncated file fails here
        raise WeightsError(f"{path}: cannot read the safetensors file (needed for tensor {wanted}): "
                           f"{type(e).__name__}: {e}; the file is truncated or damaged — copy or download it "
                           "again") from e


def _check_config(folder: Path, program: Program) -> None:
    """The folder's ``config.json`` describes the same model as ``make_model()`` (Hugging Face models only)."""
    config = getattr(program.model, "config", None)
    path = folder / "config.json"
    if config is None or not hasattr(config, "to_dict") or not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from e
    model = config.to_dict()
    for key in SHAPE_KEYS:
        if key in saved and key in model and saved[key] != model[key]:
            raise WeightsError(f"{path}: {key} is {saved[key]!r}, the model file's model "
                               f"({type(program.model).__name__}) has {model[key]!r}: a checkpoint of a different "
                               f"model; {FIX}")
    _warn_other_keys(path, _as_read(config, saved), model)


def _as_read(config, saved: dict) -> dict:
    """The folder's config as the model's configuration class reads it: older key names (a top-level
    ``rope_theta``, now inside ``rope_parameters``) land where the model's own config keeps them."""
    try:
        return type(config).from_dict(dict(saved)).to_dict()
    except Exception:  # a config its class cannot read: compare the file as written
        return saved


# bookkeeping that differs between a saved config and a built one without changing what the model computes
_NOT_COMPARED = {"transformers_version", "architectures", "torch_dtype", "dtype", "use_cache", "return_dict",
                 "output_hidden_states", "output_attentions", "name_or_path"}


def _warn_other_keys(path: Path, saved: dict, model: dict) -> None:
    """Keys beyond the shapes (``rope_theta``, ``hidden_act``, ...) change what the model computes with the
    same weights; the compile goes on (the weights fit) but says which differ."""
    differ = sorted(k for k in saved.keys() & model.keys()
                    if k not in SHAPE_KEYS and k not in _NOT_COMPARED and not k.startswith("_")
                    and saved[k] != model[k])
    if differ:
        pairs = "; ".join(f"{k}: {saved[k]!r} in the folder, {model[k]!r} in make_model()" for k in differ[:8])
        warn(f"{path}: the weights fit, but the model file's configuration differs from the folder's in "
             f"{len(differ)} key(s) ({pairs}); the model will compute differently from the one these "
             f"weights were trained as — {FIX}")


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("F", "BF"))


def _file_list(files: dict) -> str:
    names = sorted({p.name for p in files.values()})
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def weight_shards(manifest: Manifest, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Each rank's weights shard: by key, the slice of its source tensor that the rank's manifest entry records."""
    return {entry.weights: {key: take(tensors[t.source].detach(), t.slice).contiguous().clone()
                            for key, t in entry.tensors.items()}
            for entry in manifest.ranks}


def external_weights(manifest: Manifest, shards: dict[str, dict], source: CheckpointSource | None) -> Manifest:
    """Move the tensors a meta compile cannot hold out of the rank shards, into references.

    Each such manifest tensor is marked not in its shard, with the checkpoint tensor to read (or none
    without ``--weights``: the run then fails with a clear error); the manifest gets a ``weights`` section."""
    ranks = []
    for entry in manifest.ranks:
        tensors = shards[entry.weights]
        entries = dict(entry.tensors)
        for key, t in entry.tensors.items():
            name = source.names.get(t.source) if source is not None else None
            if name is not None:
                entries[key] = replace(t, in_shard=False, checkpoint=source.ref(t.source))
            elif tensors[key].is_meta:
                if source is not None and t.kind == "constant":
                    raise WeightsError(f"{source.dir}: {t.source} is a tensor made inside forward (a lifted "
                                       "constant) from tensors on the meta device, so its values are unknown "
                                       "to a compile without weights; compile without --weights (the model "
                                       "built with real weights) to keep it")
                if source is not None:
                    raise WeightsError(f"{source.dir}: {t.kind} {t.source} is in no checkpoint file and "
                                       "make_model() left it on the meta device; create it with a real value in "
                                       "the model, or save it in the checkpoint")
                entries[key] = replace(t, in_shard=False)
            else:
                continue
            del tensors[key]
        ranks.append(replace(entry, tensors=entries))
    weights = source.record() if source is not None else WeightsSource(None, {})
    return replace(manifest, ranks=tuple(ranks), weights=weights)


def shard_metadata(manifest: Manifest, shard: str) -> dict[str, str] | None:
    """The safetensors metadata of one rank shard: where its other tensors are read from at run time."""
    if manifest.weights is None:
        return None
    from fxshard.runtime.slices import KEY

    if manifest.weights.dir is None:
        return {KEY: json.dumps({"dir": None})}
    entry = next(e for e in manifest.ranks if e.weights == shard)
    refs = {k: t.checkpoint.to_json() | {"slice": t.slice.to_json()}
            | ({"shape": list(t.global_shape)} if t.checkpoint.pieces else {})
            for k, t in entry.tensors.items() if t.checkpoint is not None}
    return {KEY: json.dumps({"dir": manifest.weights.dir, "tensors": refs}, sort_keys=True)}
