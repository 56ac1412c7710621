"""Load a rank's tensors (parameters, buffers) from its safetensors shard into the generated module."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fxshard.errors import OutputFolderError
from fxshard.runtime.slices import checkpoint_specs, load_checkpoint_tensors


def load_state(module: torch.nn.Module, path: str | Path, prefix: str = "") -> None:
    """Copy every tensor of ``path`` into the parameter or buffer of the same name, checking shapes.

    ``prefix`` selects one stage's tensors (``"Stage3."``) from a rank file holding several stages.
    Tensors the shard's metadata places in a checkpoint folder (``--weights DIR``) are read from there,
    this rank's slice only (:mod:`fxshard.runtime.slices`)."""
    path = Path(path)
    if not path.is_file():
        raise OutputFolderError(f"{path}: weights file missing; recompile with `fxshard compile`")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
    except Exception as e:
        raise OutputFolderError(f"{path}: cannot read weights ({type(e).__name__}: {e}); recompile") from e
    if prefix:
        tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    external = checkpoint_specs(metadata, path, prefix)
    missing = sorted(set(own) - set(tensors) - set(external))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        raise OutputFolderError(
            f"{path}: tensors do not match the rank module: missing {missing[:5]}, unexpected {extra[:5]}; "
            "the weights and the code come from different compiles — recompile"
        )
    load_checkpoint_tensors(own, external, path)
    with torch.no_grad():
        for name, target in own.items():
            if name in external:
                continue
            src = tensors[name]
            if tuple(src.shape) != tuple(target.shape):
                raise OutputFolderError(
                    f"{path}: tensor {name} has shape {tuple(src.shape)}, the rank module expects "
                    f"{tuple(target.shape)}; recompile"
                )
            target.copy_(src)
