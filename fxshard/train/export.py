"""``fxshard export CKPT --hf OUT_DIR``: a checkpoint's trained weights as a Hugging Face model folder.

The model is built from the checkpoint's copy of the model file (``make_model()``), every parameter is
replaced by the checkpoint's full tensor (assembled from the saved slices, whatever the layout), and
``save_pretrained`` writes config.json and safetensors, tied weights included::

    export_hf("ckpt", "hf-out")
    AutoModelForCausalLM.from_pretrained("hf-out")   # bit-identical to the trained weights

A model that is not a Hugging Face ``PreTrainedModel`` gets ``model.safetensors`` of its state dict.

The folder is treated as compile treats ``--out`` (:mod:`fxshard.files.staged`): only a new or empty folder, or
one an earlier export wrote (``fxshard-export.json`` lists its files), is written; the export is written into a
hidden sibling and swapped in, a user's own files in it (a tokenizer, a README) are kept, and the checkpoint's
own folders are refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from fxshard.capture.lora import is_peft_model
from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import inside
from fxshard.errors import OutputFolderError
from fxshard.files import (
    JOURNAL,
    STAGE,
    FolderKind,
    check_target,
    path_for_library,
    recover_interrupted,
    staged_output,
    write_text,
)
from fxshard.train.checkpoint import CheckpointError, CheckpointReader, find_checkpoint
from fxshard.train.resume_checks import check_checkpoint

EXPORT_RECORD = "fxshard-export.json"  # the files an export wrote, so the next export may replace them
EXPORT_FORMAT = "fxshard-export-1"


def _exported_files(record: Path) -> set[str] | None:
    """The files the export that wrote ``record`` wrote (itself included), or None if fxshard did not write it."""
    try:
        data = json.loads(record.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(data, dict) and data.get("format") == EXPORT_FORMAT and isinstance(data.get("files"), list)):
        return None
    return {EXPORT_RECORD} | {f for f in data["files"] if isinstance(f, str)}


EXPORT = FolderKind("export", "export", "export", "--hf", EXPORT_RECORD, _exported_files)
PEFT_EXPORT = FolderKind("export", "export", "export", "--peft", EXPORT_RECORD, _exported_files)


def trained_model(checkpoint: str | Path, model_file: str | Path | None = None,
                  meta_base: bool = False) -> tuple[torch.nn.Module, Path]:
    """The unmodified model with the checkpoint's trained parameters, and the checkpoint folder read.  A LoRA
    compile's checkpoint gives its peft model: the adapters trained, the base the compile's (``make_model()`` at the
    seed, or the ``--weights`` folder it read); ``meta_base``: the base on meta tensors (for the adapters alone)."""
    from fxshard.ir.layout import Layout
    from fxshard.train.checkpoint import FROZEN

    reader = CheckpointReader(check_checkpoint(checkpoint, print))  # a damaged file named before any reading
    if model_file is None:
        model_file = inside(reader.path, "model.py", "the model copy", reader.path, CheckpointError)
        _refuse_edited_copy(model_file, reader.index.get("model_digest"))
    model_file = Path(model_file)
    if not model_file.is_file():
        raise CheckpointError(f"{model_file}: model file missing; pass the model with --model MODEL.py")
    mf = load_model_file(model_file)
    if isinstance(reader.index.get("layout"), dict):  # --lora: the adapters it was compiled with
        mf = mf.for_layout(Layout.from_json(reader.index["layout"]))
    base_weights = (reader.index.get(FROZEN) or {}).get("weights")
    if base_weights is not None and not meta_base:
        from fxshard.check.verify import with_weights

        mf = with_weights(mf, Path(base_weights))
    model = mf.build_model(int(reader.index.get("seed", 0)), meta=meta_base)
    # one name per tied weight; the checkpoint may hold it under another of its names (an alias)
    params = {reader.canonical(name): p for name, p in model.named_parameters() if name not in reader.frozen}
    missing = sorted(set(params) - set(reader.sources))
    extra = sorted(set(reader.sources) - set(params))
    if missing or extra:
        raise CheckpointError(
            f"{reader.path}: the checkpoint does not fit {model_file}: tensor {(missing or extra)[0]} is "
            f"{'missing from the checkpoint' if missing else 'not a parameter of the model'} ({len(missing)} "
            f"missing, {len(extra)} unexpected); export with the model it was trained from (--model)")
    with torch.no_grad():
        for name, p in params.items():
            value = reader.tensor(name)
            if tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(f"{reader.path}: tensor {name} has shape {tuple(value.shape)}, "
                                      f"{model_file} expects {tuple(p.shape)}")
            p.data = value.to(p.dtype) if value.dtype != p.dtype else value.clone()
    return model, reader.path


def _refuse_edited_copy(model_file: Path, digest: str | None) -> None:
    """The checkpoint's model.py is what was saved with it (its sha256 starts with the index's model_digest);
    an edited copy is refused, as ``run`` refuses an edited compiled folder, before it runs."""
    if not digest or not model_file.is_file():
        return
    found = hashlib.sha256(model_file.read_bytes()).hexdigest()
    if not found.startswith(digest):
        raise CheckpointError(f"{model_file}: differs from the model file this checkpoint was saved with (sha256 "
                              f"{found[:16]}, the index records {digest}): edited after the save. Export with a "
                              "model file you trust: --model MODEL.py")


def export_hf(checkpoint: str | Path, out_dir: str | Path, model_file: str | Path | None = None,
              merge: bool = False) -> Path:
    """Write the trained model to ``out_dir`` (Hugging Face layout); return the checkpoint folder read.  A LoRA
    checkpoint takes ``merge``: each adapted weight becomes ``W + scaling * B @ A`` (peft's ``merge_and_unload``),
    the model the base's own class with its own names."""
    out_dir = Path(out_dir).resolve()
    _refuse_checkpoint_folder(Path(checkpoint), out_dir)
    recover_interrupted(out_dir, EXPORT)
    check_target(out_dir, set(), EXPORT)  # a folder not an export's: refused before the model is built
    model, path = trained_model(checkpoint, model_file)
    if is_peft_model(model) and not merge:
        raise CheckpointError(f"{path}: a LoRA checkpoint holds adapters on a frozen base; --hf writes a whole model, "
                              "so add --merge (each adapted weight W + scaling * B @ A), or write the adapters alone "
                              "with --peft DIR")
    if merge and not is_peft_model(model):
        raise CheckpointError(f"{path}: --merge merges LoRA adapters, and this checkpoint has none (its compile had "
                              "no --lora and its model no peft adapters); drop --merge")
    if merge:
        model = model.merge_and_unload()
    with staged_output(out_dir, set(), EXPORT) as stage:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(stage, safe_serialization=True)  # transformers writes into the staging folder
        else:
            from safetensors.torch import save_model

            with path_for_library(stage / "model.safetensors", "the exported weights", owner=STAGE) as tmp:
                save_model(model, str(tmp))
        files = sorted(p.name for p in stage.iterdir() if p.name != JOURNAL)
        write_text(stage / EXPORT_RECORD, json.dumps({"format": EXPORT_FORMAT, "files": files}, indent=1) + "\n",
                   "the export's record", owner=STAGE)
    return path


def _refuse_checkpoint_folder(checkpoint: Path, out_dir: Path) -> None:
    """``--hf`` naming the checkpoint folder itself, or the step it reads (or a folder inside it), would put the
    export among the files of the checkpoint it reads."""
    step = find_checkpoint(checkpoint).resolve()
    root = step.parent
    if out_dir.is_relative_to(step) or out_dir in (root, checkpoint.resolve()):
        what = f"the checkpoint's {step.name}" if out_dir.is_relative_to(step) else "the checkpoint folder"
        inner = " (a folder inside it)" if out_dir.is_relative_to(step) and out_dir != step else ""
        raise OutputFolderError(f"--hf {out_dir}: is {what}{inner}, which the export reads; export into a folder of "
                                f"its own, e.g. --hf {root}-hf")


def export_peft(checkpoint: str | Path, out_dir: str | Path, model_file: str | Path | None = None) -> Path:
    """Write a LoRA checkpoint's adapters to ``out_dir`` as peft saves them (``adapter_model.safetensors`` with peft's
    key names, ``adapter_config.json``), which ``peft.PeftModel.from_pretrained(base, out_dir)`` loads onto the base
    model; return the checkpoint folder read.  The base is built on meta tensors: nothing of it is read or written."""
    out_dir = Path(out_dir).resolve()
    _refuse_checkpoint_folder(Path(checkpoint), out_dir)
    recover_interrupted(out_dir, PEFT_EXPORT)
    check_target(out_dir, set(), PEFT_EXPORT)
    model, path = trained_model(checkpoint, model_file, meta_base=True)
    if not is_peft_model(model):
        raise CheckpointError(f"{path}: --peft writes LoRA adapters, and this checkpoint has none (its compile had no "
                              "--lora and its model no peft adapters); export the whole model with --hf DIR")
    with staged_output(out_dir, set(), PEFT_EXPORT) as stage:
        model.save_pretrained(str(stage))
        files = sorted(p.name for p in stage.iterdir() if p.name != JOURNAL)
        write_text(stage / EXPORT_RECORD, json.dumps({"format": EXPORT_FORMAT, "files": files}, indent=1) + "\n",
                   "the export's record", owner=STAGE)
    return path
