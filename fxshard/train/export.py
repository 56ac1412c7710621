"""``fxshard export CKPT --hf OUT_DIR``: a checkpoint's trained weights as a Hugging Face model folder.

The model is built from the checkpoint's copy of the model file (``make_model()``), every parameter is
replaced by the checkpoint's full tensor (assembled from the saved slices, whatever the layout), and
``save_pretrained`` writes config.json and safetensors, tied weights included::

    export_hf("ckpt", "hf-out")
    AutoModelForCausalLM.from_pretrained("hf-out")   # bit-identical to the trained weights

A model that is not a Hugging Face ``PreTrainedModel`` gets ``model.safetensors`` of its state dict.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import inside
from fxshard.train.checkpoint import CheckpointError, CheckpointReader, check_checkpoint


def trained_model(checkpoint: str | Path, model_file: str | Path | None = None) -> tuple[torch.nn.Module, Path]:
    """The unmodified model with the checkpoint's trained parameters, and the checkpoint folder read."""
    reader = CheckpointReader(check_checkpoint(checkpoint, print))  # a damaged file named before any reading
    if model_file is None:
        model_file = inside(reader.path, "model.py", "the model copy", reader.path, CheckpointError)
        _refuse_edited_copy(model_file, reader.index.get("model_digest"))
    model_file = Path(model_file)
    if not model_file.is_file():
        raise CheckpointError(f"{model_file}: model file missing; pass the model with --model MODEL.py")
    model = load_model_file(model_file).build_model(int(reader.index.get("seed", 0)))
    # one name per tied weight; the checkpoint may hold it under another of its names (an alias)
    params = {reader.canonical(name): p for name, p in model.named_parameters()}
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


def export_hf(checkpoint: str | Path, out_dir: str | Path, model_file: str | Path | None = None) -> Path:
    """Write the trained model to ``out_dir`` (Hugging Face layout); return the checkpoint folder read."""
    model, path = trained_model(checkpoint, model_file)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out_dir, safe_serialization=True)
    else:
        from safetensors.torch import save_model

        save_model(model, str(out_dir / "model.safetensors"))
    return path
