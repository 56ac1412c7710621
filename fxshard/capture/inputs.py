"""Match a batch (model-file convention) to the flat inputs of the compiled forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from fxshard.errors import ModelFileError


class InputSpec(Protocol):
    """One input of the compiled forward, as a batch is matched to it (the manifest's ``InputEntry`` is one)."""

    name: str
    path: str  # pytree key path into (args, kwargs)
    is_tensor: bool
    shape: Sequence[int]
    counted_by: str  # an input that does not lead with the batch: the mask it is counted by (fxshard.capture.rows)
    whole: bool  # ... or one never split


def flatten_batch(batch: Any, specs: Sequence[InputSpec], rows: int | None = None) -> list[Any]:
    """The values of ``batch`` in the order of the compiled forward's inputs (the manifest's ``inputs``),
    checking shapes.  ``rows``: the batch is one dp rank's share, ``rows`` rows of each tensor input (an input the
    rank does not read may be None: :func:`fxshard.train.data.inputs_read`)."""
    args, kwargs = ((), dict(batch)) if isinstance(batch, dict) else (tuple(batch), {})
    leaves = {pytree.keystr(p): v for p, v in pytree.tree_flatten_with_path((args, kwargs))[0]}
    whole_rows = next((s.shape[0] for s in specs if s.is_tensor and s.shape and not _apart(s)), None)
    out = []
    for s in specs:
        if s.path not in leaves:
            raise ModelFileError(
                f"the batch has no input at {s.path} ({s.name}); it was compiled with inputs "
                f"{[x.path for x in specs]} — batches must have the same structure as make_inputs()"
            )
        v = leaves[s.path]
        if s.is_tensor and not (rows is not None and v is None):
            shape = list(s.shape) if rows is None or s.whole else \
                [s.shape[0] * rows // whole_rows, *s.shape[1:]] if s.counted_by else [rows, *s.shape[1:]]
            if not isinstance(v, torch.Tensor) or list(v.shape) != shape:
                found = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ModelFileError(
                    f"batch input {s.name} has shape {found}; the program was compiled for {shape}. "
                    "Shapes are fixed at compile time: recompile with make_inputs() returning this shape"
                )
        out.append(v)
    return out


def _apart(spec) -> bool:
    """An input that does not lead with the batch (``counted_by`` a mask, or ``whole``: fxshard.capture.rows)."""
    return bool(spec.counted_by or spec.whole)
