"""Train a compiled folder from your own loop: your DataLoader, a torch LR scheduler, your metrics.

    fxshard compile samples/llama.py --tp 2 --dp 2 --out out/llama-tp2-dp2
    torchrun --nproc-per-node 4 samples/own_loop.py out/llama-tp2-dp2 --steps 20

``fxshard.load`` gives this rank its part of the compiled program; everything else is ordinary torch.  Each rank
reads the same global batches (a seeded dataset) and keeps its share with ``program.local_batch``; the loss that
``train_step`` returns is the whole batch's, the same on every rank.  The scheduler below is the warmup-and-cosine
formula of ``fxshard run --lr-schedule cosine`` (docs/training.md), so this loop and
``fxshard run --lr-schedule cosine --warmup-steps 2 --clip-grad-norm 1`` on the same batches print the same losses.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import fxshard

VOCAB, SEQ, ROWS = 256, 16, 4  # samples/llama.py's vocabulary, sequence and global batch


class RandomTokens(Dataset):
    """Your corpus goes here: ``size`` sequences of token ids, the same on every rank (seeded)."""

    def __init__(self, size: int = 1024, seed: int = 1234):
        self.ids = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def warmup_cosine(warmup: int, steps: int, floor: float = 0.0):
    """The factor of the base learning rate at optimizer step ``s``: linear warmup, then a cosine to ``floor``."""
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        p = min(1.0, (s - warmup) / (steps - warmup))
        return floor + (1.0 - floor) * (0.5 * (1.0 + math.cos(math.pi * p)))
    return factor


def main(out: str, steps: int = 20, lr: float = 3e-3, warmup: int = 2, checkpoint: str | None = None,
         metrics: str | None = None, log=print) -> list[float]:
    with fxshard.load(out, lr=lr, weight_decay=0.1) as program:  # its end waits for what is still in flight
        scheduler = torch.optim.lr_scheduler.LambdaLR(program.optimizer, warmup_cosine(warmup, steps))
        loader = DataLoader(RandomTokens(), batch_size=ROWS, shuffle=False, drop_last=True)
        first = torch.distributed.get_rank() == 0
        losses, records = [], []
        for step, ids in zip(range(1, steps + 1), loader, strict=False):
            start = time.perf_counter()
            batch = program.local_batch({"input_ids": ids, "labels": ids, "use_cache": False})
            loss = program.train_step(batch)             # forward + backward of this rank's share
            norm = program.clip_grad_norm_(1.0)          # the global norm over every shard, before clipping
            lr_now = scheduler.get_last_lr()[0]
            program.optimizer.step()
            scheduler.step()
            program.optimizer.zero_grad()
            losses.append(loss)
            if first:
                seconds = time.perf_counter() - start
                log(f"step {step}/{steps}  loss {loss:.6f}  lr {lr_now:.2e}  grad norm {norm:.3f}  "
                    f"{ROWS * SEQ / seconds:,.0f} tokens/s")
                records.append({"step": step, "loss": loss, "lr": lr_now, "seconds": seconds})
        if metrics and first:  # JSON lines, as fxshard run --metrics writes
            Path(metrics).write_text("".join(json.dumps(r) + "\n" for r in records))
        if checkpoint is not None:  # the checkpoints of fxshard run --checkpoint: `fxshard run --resume` continues it
            program.save(checkpoint, scheduler=scheduler)
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="compiled folder (fxshard compile ... --out OUT)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", help="save a checkpoint here after the last step")
    parser.add_argument("--metrics", help="write one JSON line per step here: step, loss, lr, seconds")
    args = parser.parse_args()
    main(args.out, args.steps, args.lr, checkpoint=args.checkpoint, metrics=args.metrics)
    torch.distributed.destroy_process_group()
