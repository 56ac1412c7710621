"""Read a rank's parameters from a Hugging Face checkpoint folder, slice by slice.

A program compiled with ``--weights DIR`` writes no parameter shards.  Each rank's small shard file
(buffers only) carries, in its safetensors metadata under :data:`KEY`, where each of its parameters
lives: checkpoint file, tensor name and the :class:`~fxshard.ir.placement.SliceSpec` it holds.  A rank
reads exactly those ranges with ``safe_open(file).get_slice(name)[...]`` (one read per packed block of
a fused q/k/v), never the full tensor::

    spec = {"file": "/ckpt/model.safetensors", "name": "model.layers.0.mlp.up_proj.weight",
            "slice": {"dim": 0, "index": 1, "parts": 2, "blocks": 1}}
    read_slice(spec)   # rows 1/2 of the tensor, the only bytes read
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fxshard.errors import OutputFolderError

KEY = "fxshard.checkpoint"  # shard metadata: JSON {"dir": ..., "tensors": {key: spec}} or {"dir": null}
NO_WEIGHTS = "compiled without weights (on meta tensors): recompile with --weights DIR, a Hugging Face folder"


def checkpoint_specs(metadata: dict | None, path: Path, prefix: str = "") -> dict[str, dict]:
    """The tensors of a shard that live in the checkpoint folder, keyed without ``prefix``."""
    if not metadata or KEY not in metadata:
        return {}
    info = json.loads(metadata[KEY])
    if info.get("dir") is None:
        raise OutputFolderError(f"{path}: {NO_WEIGHTS}")
    return {k[len(prefix):]: v for k, v in info["tensors"].items() if k.startswith(prefix)}


def read_slice(spec: dict) -> torch.Tensor:
    """The part of a checkpoint tensor that ``spec`` names, reading only that part."""
    from safetensors import safe_open

    file, name, sl = spec["file"], spec["name"], spec["slice"]
    try:
        with safe_open(file, framework="pt") as f:
            view = f.get_slice(name)
            shape = view.get_shape()
            if sl["parts"] == 1:
                return view[tuple(slice(None) for _ in shape)] if shape else f.get_tensor(name)
            dim = sl["dim"]
            block = shape[dim] // sl["blocks"]
            step = block // sl["parts"]
            pieces = []
            for b in range(sl["blocks"]):
                start = b * block + sl["index"] * step
                index = tuple(slice(start, start + step) if d == dim else slice(None) for d in range(len(shape)))
                pieces.append(view[index])
            return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]
    except Exception as e:  # a file changed or truncated after compile
        raise OutputFolderError(f"{file}: cannot read tensor {name} ({type(e).__name__}: {e}); check the "
                                "checkpoint folder is complete, then recompile with --weights") from e


def load_checkpoint_tensors(targets: dict[str, torch.Tensor], specs: dict[str, dict], path: Path) -> int:
    """Copy each spec's slice into its target (cast to the target's dtype); return the bytes read."""
    read = 0
    with torch.no_grad():
        for key, spec in specs.items():
            target = targets[key]
            src = read_slice(spec)
            if tuple(src.shape) != tuple(target.shape):
                raise OutputFolderError(f"{path}: {spec['file']} tensor {spec['name']} gives a slice of shape "
                                        f"{tuple(src.shape)} for {key}, the rank module expects "
                                        f"{tuple(target.shape)}; recompile with --weights")
            read += src.numel() * src.element_size()
            target.copy_(src.to(target.dtype))
    return read
