"""What every tool of the peers benchmark shares: the layouts, a peer's training step, the batch's rows.

A layout is one world of gloo (or NCCL) processes that every tool trains in turn; a :class:`Peer` is one tool's
model, optimizer and step on this rank::

    LAYOUTS["tp2"]                     # PeerLayout(name='tp2', tp=2, pp=1, dp=1, sharded=True)
    peer.step()                        # forward, backward, gradient norm, AdamW: the loss (None off the last stage)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

MICROBATCHES = 4  # per step under pp: every tool's 1F1B runs the same number


@dataclass(frozen=True)
class PeerLayout:
    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sharded: bool = True  # dp: parameters, gradients and optimizer state sharded (ZeRO 3, FSDP2), or replicated (DDP)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        return MICROBATCHES if self.pp > 1 else 1


LAYOUTS = {layout.name: layout for layout in (
    PeerLayout("tp2", tp=2), PeerLayout("dp2", dp=2), PeerLayout("dp2-replicated", dp=2, sharded=False),
    PeerLayout("pp2", pp=2), PeerLayout("tp2dp2", tp=2, dp=2),
    PeerLayout("tp2dp2-replicated", tp=2, dp=2, sharded=False))}


@dataclass
class Peer:
    """One tool on this rank: ``step()`` trains one step on the fixed batch and returns the global batch's mean loss
    where this rank knows it (``reports_loss``), else None."""

    step: Callable[[], float | None]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    reports_loss: bool = True


def local_rows(t: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """This dp rank's rows of a global batch tensor, as one device's batch splits into dp ranks' (in rank order)."""
    return t.chunk(dp, dim=0)[dp_rank]


def microbatches(batch: dict, count: int) -> list[dict]:
    """``batch`` split into ``count`` microbatches along its rows; tensors with other leading sizes (a mask shared by
    every row) go to each whole."""
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() == 2)
    parts = [{} for _ in range(count)]
    for key, value in batch.items():
        split = isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows and rows > 1
        for i, part in enumerate(parts):
            part[key] = value.chunk(count, dim=0)[i] if split else value
    return parts
