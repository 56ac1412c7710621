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


def flatten_batch(batch: Any, specs: Sequence[InputSpec], rows: int | None = None) -> list[Any]:
    """The values of ``batch`` in the order of the compiled forward's inputs (the manifest's ``inputs``),
    checking shapes.  ``rows``: the batch is one dp rank's share, ``rows`` rows of each tensor input (an input the
    rank does not read may be None: :func:`fxshard.train.data.inputs_read`)."""
    args, kwargs = ((), dict(batch)) if isinstance(batch, dict) else (tuple(batch), {})
    leaves = {pytree.keystr(p): v for p, v in pytree.tree_flatten_with_path((args, kwargs))[0]}
    out = []
    for s in specs:
        if s.path not in leaves:
            raise ModelFileError(
                f"the batch has no input at {s.path} ({s.name}); it was compiled with inputs "
                f"{[x.path for x in specs]} — batches must have the same structure as make_inputs()"
            )
        v = leaves[s.path]
        if s.is_tensor and not (rows is not None and v is None):
            shape = list(s.shape) if rows is None else [rows, *s.shape[1:]]
            if not isinstance(v, torch.Tensor) or list(v.shape) != shape:
                found = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ModelFileError(
                    f"batch input {s.name} has shape {found}; the program was compiled for {shape}. "
                    "Shapes are fixed at compile time: recompile with make_inputs() returning this shape"
                )
        out.append(v)
    return out
