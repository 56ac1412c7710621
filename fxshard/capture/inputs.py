"""Match a batch (model-file convention) to the flat inputs of the compiled forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from fxshard.errors import ModelFileError

if TYPE_CHECKING:
    from fxshard.codegen.manifest import InputEntry


def flatten_batch(batch: Any, specs: Sequence[InputEntry]) -> list[Any]:
    """The values of ``batch`` in the order of the compiled forward's inputs (the manifest's ``inputs``),
    checking shapes."""
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
        if s.is_tensor:
            if not isinstance(v, torch.Tensor) or list(v.shape) != list(s.shape):
                found = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ModelFileError(
                    f"batch input {s.name} has shape {found}; the program was compiled for {list(s.shape)}. "
                    "Shapes are fixed at compile time: recompile with make_inputs() returning this shape"
                )
        out.append(v)
    return out
