"""Local (communication-free) pieces of tensor-parallel layers."""

from __future__ import annotations

import torch


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Look up ids that fall in this rank's rows ``[start, end)``; other ids give zeros.

    The result is a partial sum over the tensor-parallel group: all-reduce it to get the embedding.
    """
    outside = (ids < start) | (ids >= end)
    local = (ids - start).masked_fill(outside, 0)
    out = torch.nn.functional.embedding(local, weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)
