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
    batches = mf.batches(steps, seed)
    positional = not isinstance(batches[0], dict)
    step_fn = _WithLoss(model, mf.loss_fn, positional)
    opt = optim.make(model.parameters())
    losses = []
    for batch in batches:
        loss, _ = step_fn(*batch) if positional else step_fn(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def set_threads(n: int = 1) -> None:
    torch.set_num_threads(n)
