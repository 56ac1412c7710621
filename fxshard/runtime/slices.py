"""Slices of a tensor, and reading them from a Hugging Face checkpoint folder.

One arithmetic says which part of a dimension a rank holds: :func:`part_ranges`, the ranges of part
``index`` of ``parts`` inside each of ``blocks`` equal blocks (one block for a plain split; three for a
packed q/k/v projection, where part ``r`` is ``[q_r, k_r, v_r]``).  :class:`SliceSpec` records it in the
manifest, :func:`take` and :func:`assemble` cut and join tensors by it, and the collectives, the dropout
masks and the checkpoint reads below use the same ranges::

    part_ranges(12, index=1, parts=2, blocks=3)   # [(2, 4), (6, 8), (10, 12)]

A program compiled with ``--weights DIR`` writes no parameter shards.  Each rank's small shard file
(buffers only) carries, in its safetensors metadata under :data:`KEY`, where each of its parameters
lives: checkpoint file, tensor name and the :class:`SliceSpec` it holds.  A rank reads exactly those
ranges with ``safe_open(file).get_slice(name)[...]`` (one read per packed block of a fused q/k/v),
never the full tensor::

    spec = {"file": "/ckpt/model.safetensors", "name": "model.layers.0.mlp.up_proj.weight",
            "slice": {"dim": 0, "index": 1, "parts": 2, "blocks": 1}}
    read_slice(spec)   # rows 1/2 of the tensor, the only bytes read
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fxshard.errors import OutputFolderError

KEY = "fxshard.checkpoint"  # shard metadata: JSON {"dir": ..., "tensors": {key: spec}} or {"dir": null}
NO_WEIGHTS = "compiled without weights (on meta tensors): recompile with --weights DIR, a Hugging Face folder"


def part_ranges(size: int, index: int, parts: int, blocks: int = 1, sizes: tuple[int, ...] = (),
                replicas: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """``[(start, stop), ...]``: the ranges of a dimension of ``size`` that part ``index`` of ``parts`` holds,
    one inside each of ``blocks`` equal blocks, in order.  ``sizes``: the blocks' sizes when unequal (a Mamba-2
    ``in_proj``'s z, x, B, C, dt); ``replicas``: per block, how many consecutive parts hold the same range (a
    block of k replicas is cut into parts // k ranges and part ``index`` holds range ``index // k``).

    >>> part_ranges(8, 1, 2), part_ranges(12, 1, 2, blocks=3), part_ranges(10, 1, 2, 2, (8, 2), (1, 2))
    ([(4, 8)], [(2, 4), (6, 8), (10, 12)], [(4, 8), (8, 10)])
    """
    out, start = [], 0
    for b, block in enumerate(sizes or (size // blocks,) * blocks):
        k = replicas[b] if replicas else 1
        step = block * k // parts
        out.append((start + index // k * step, start + (index // k + 1) * step))
        start += block
    return out


@dataclass(frozen=True)
class SliceSpec:
    """Which part of a source tensor one rank holds: the manifest's record of a local tensor.

    ``index`` of ``parts`` along ``dim``, inside each of ``blocks`` blocks (equal, or of ``sizes``), each
    block's part held by ``replicas`` consecutive ranks (:func:`part_ranges`).  ``parts == 1`` means the whole
    tensor.
    """

    dim: int = 0
    index: int = 0
    parts: int = 1
    blocks: int = 1
    sizes: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()

    def ranges(self, size: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` along ``dim`` of a source dimension of ``size``."""
        return part_ranges(size, self.index, self.parts, self.blocks, self.sizes, self.replicas)

    def to_json(self) -> dict:
        return ({"dim": self.dim, "index": self.index, "parts": self.parts, "blocks": self.blocks}
                | ({"sizes": list(self.sizes)} if self.sizes else {})
                | ({"replicas": list(self.replicas)} if self.replicas else {}))

    @classmethod
    def from_json(cls, data: dict) -> SliceSpec:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def take(full: torch.Tensor, sl: SliceSpec) -> torch.Tensor:
    """The part of ``full`` that ``sl`` describes (a copy-free view where possible)."""
    if sl.parts == 1:
        return full
    pieces = [full.narrow(sl.dim, a, b - a) for a, b in sl.ranges(full.shape[sl.dim])]
    return torch.cat(pieces, dim=sl.dim) if len(pieces) > 1 else pieces[0]


def place(full: torch.Tensor, local: torch.Tensor, sl: SliceSpec) -> None:
    """Copy ``local`` (what :func:`take` gives for ``sl``) into its ranges of ``full``."""
    if sl.parts == 1:
        full.copy_(local)
        return
    at = 0
    for a, b in sl.ranges(full.shape[sl.dim]):
        full.narrow(sl.dim, a, b - a).copy_(local.narrow(sl.dim, at, b - a))
        at += b - a


def assemble(pieces, shape) -> torch.Tensor:
    """Rebuild a full tensor of ``shape`` from ``[(SliceSpec, local), ...]`` covering it."""
    full = torch.empty(shape, dtype=pieces[0][1].dtype)
    for sl, local in pieces:
        place(full, local, sl)
    return full


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

    if spec.get("pieces"):
        return read_built(spec)
    file, name, sl = spec["file"], spec["name"], SliceSpec.from_json(spec["slice"])
    try:
        with safe_open(file, framework="pt") as f:
            view = f.get_slice(name)
            shape = view.get_shape()
            if sl.parts == 1:
                return view[tuple(slice(None) for _ in shape)] if shape else f.get_tensor(name)
            pieces = [view[tuple(slice(a, b) if d == sl.dim else slice(None) for d in range(len(shape)))]
                      for a, b in sl.ranges(shape[sl.dim])]
            return torch.cat(pieces, dim=sl.dim) if len(pieces) > 1 else pieces[0]
    except Exception as e:  # a file changed or truncated after compile
        raise OutputFolderError(f"{file}: cannot read tensor {name} ({type(e).__name__}: {e}); check the "
                                "checkpoint folder is complete, then recompile with --weights") from e


def read_built(spec: dict) -> torch.Tensor:
    """This rank's part of a tensor built from several checkpoint tensors (``spec["pieces"]``: hub experts, one
    tensor each, inside the model's stacked ``gate_up_proj``), reading from each piece only what the part covers:
    under ``--ep`` the rank's experts and no other, under ``moe_tp_experts`` its rows of each expert::

        spec = {"name": "model.layers.0.mlp.experts.gate_up_proj", "shape": [4, 32, 32],
                "slice": {"dim": 1, "index": 1, "parts": 2, "blocks": 2},
                "pieces": [{"name": "model.layers.0.mlp.experts.0.gate_proj.weight", "file": "/ckpt/model.safetensors",
                            "shape": [16, 32], "start": [0, 0, 0], "stack": 0}, ...]}
    """
    shape, sl = spec["shape"], SliceSpec.from_json(spec["slice"])
    dim = sl.dim
    ranges = sl.ranges(shape[dim]) if sl.parts > 1 else [(0, shape[dim])]
    local = list(shape)
    local[dim] = sum(b - a for a, b in ranges)
    out, filled, files = None, 0, {}
    try:
        for piece in spec["pieces"]:
            start, stack = piece["start"], piece["stack"]
            box = [*piece["shape"][:stack], 1, *piece["shape"][stack:]]
            at = 0
            for a, b in ranges:
                lo, hi = max(a, start[dim]), min(b, start[dim] + box[dim])
                if lo < hi:
                    region = [slice(s, s + n) for s, n in zip(start, box, strict=True)]
                    region[dim] = slice(lo, hi)
                    value = read_region(files, piece, region).unsqueeze(stack)
                    if out is None:
                        out = torch.empty(local, dtype=value.dtype)
                    region[dim] = slice(at + lo - a, at + hi - a)
                    out[tuple(region)] = value
                    filled += value.numel()
                at += b - a
    except Exception as e:  # a file changed or truncated after compile
        raise OutputFolderError(f"{piece['file']}: cannot read tensor {piece['name']} (part of {spec['name']}: "
                                f"{type(e).__name__}: {e}); check the checkpoint folder is complete, then recompile "
                                "with --weights") from e
    finally:
        for f in files.values():
            f.__exit__(None, None, None)
    if out is None or filled != out.numel():
        raise OutputFolderError(f"{spec['name']}: its pieces cover {filled} of the {math.prod(local)} values of this "
                                "rank's slice; recompile with --weights")
    return out


def read_region(files: dict, piece: dict, region: list[slice]) -> torch.Tensor:
    """``region`` of the built tensor (inside the piece's box), read from the piece as the checkpoint holds it: the
    stack dimension left out, offsets made the piece's own.  Files stay open in ``files`` for the pieces after it."""
    from safetensors import safe_open

    if piece["file"] not in files:
        files[piece["file"]] = safe_open(piece["file"], framework="pt").__enter__()
    own = tuple(slice(r.start - s, r.stop - s) for d, (r, s) in enumerate(zip(region, piece["start"], strict=True))
                if d != piece["stack"])
    return files[piece["file"]].get_slice(piece["name"])[own]


def load_checkpoint_tensors(targets: dict[str, torch.Tensor], specs: dict[str, dict], path: Path) -> int:
    """Copy each spec's slice into its target (cast to the target's dtype); return the bytes read."""
    read = 0
    with torch.no_grad():
        for key, spec in specs.items():
            target = targets[key]
            src = read_slice(spec)
            if tuple(src.shape) != tuple(target.shape):
                source = (f"{spec['file']} tensor {spec['name']} gives" if spec.get("file") else
                          f"the {len(spec.get('pieces') or ())} checkpoint tensors that build {spec['name']} give")
                raise OutputFolderError(f"{path}: {source} a slice of shape "
                                        f"{tuple(src.shape)} for {key}, the rank module expects "
                                        f"{tuple(target.shape)}; recompile with --weights")
            read += src.numel() * src.element_size()
            target.copy_(src.to(target.dtype))
    return read
