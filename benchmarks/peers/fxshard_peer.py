"""fxshard as its users train with it: the model file compiled for the layout (``fxshard.driver.compile``), each rank
running its generated rank file through :class:`fxshard.train.program.Program` (what ``fxshard run`` and
``fxshard.load`` drive: dp, ZeRO, the 1F1B schedule, gradient norm, AdamW)::

    compile_layout(layout, out)                              # in the parent, once per layout
    peer = fxshard_peer(out, batch, torch.device("cpu"))     # on each rank
    loss = peer.step()                                       # the global batch's mean loss, on every rank
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.peers.common import MICROBATCHES, Peer, PeerLayout

MODEL_FILE = Path(__file__).resolve().parent.parent / "models" / "peer_llama.py"


def fxshard_layout(layout: PeerLayout, dtype: str = "fp32"):
    """fxshard's ``Layout`` for a peers layout: dp as ZeRO 3 (FSDP2, as torchtitan shards), or replicated (ZeRO 0:
    gradients all-reduced, as DDP), pp as 1F1B."""
    from fxshard.ir.layout import Layout

    zero = 3 if layout.dp > 1 and layout.sharded else 0
    return Layout(tp=layout.tp, pp=layout.pp, dp=layout.dp, zero=zero, schedule="1f1b",
                  microbatches=MICROBATCHES if layout.pp > 1 else None, dtype=dtype)


def compile_layout(layout: PeerLayout, out: Path, dtype: str = "fp32") -> Path:
    from fxshard.driver import compile

    compile(MODEL_FILE, fxshard_layout(layout, dtype), out=out, seed=0)
    return out


def fxshard_peer(out: Path, batch: dict, device: torch.device, compile: bool = False) -> Peer:
    """This rank's compiled program, stepped on its share of ``batch`` (the global batch)."""
    from fxshard.train.options import RunOptions
    from fxshard.train.program import Program

    program = Program(Path(out), RunOptions(steps=10**6, compile=compile), device)
    local = program.local_batch(batch)
    return Peer(step=lambda: program.step(local))
