"""Single-device training of the unmodified model: what distributed runs must match."""

from __future__ import annotations

import torch

from fxshard.capture import _WithLoss
from fxshard.modelfile import ModelFile
from fxshard.training import OptimConfig


def reference_losses(mf: ModelFile, steps: int, optim: OptimConfig = OptimConfig(), seed: int = 0) -> list[float]:
    """Losses of ``steps`` AdamW steps on one device, from the same initial weights and batches."""
    model = mf.build_model(seed)
    model.train()
    batches = mf.batches(1, seed)
    positional = not isinstance(batches[0], dict)
    step_fn = _WithLoss(model, mf.loss_fn, positional)
    opt = optim.make(model.parameters())
    batches = mf.batches(steps * optim.grad_accum, seed)
    losses = []
    for i in range(steps):
        total = 0.0
        for batch in batches[i * optim.grad_accum:(i + 1) * optim.grad_accum]:
            loss, _ = step_fn(*batch) if positional else step_fn(**batch)
            (loss / optim.grad_accum).backward()
            total += float(loss.detach())
        if optim.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad_norm, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / optim.grad_accum)
    return losses


def set_threads(n: int = 1) -> None:
    torch.set_num_threads(n)
