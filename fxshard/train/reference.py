"""Single-device training of the unmodified model: what distributed runs must match."""

from __future__ import annotations

import torch

from fxshard.capture.modelfile import ModelFile
from fxshard.capture.program import _WithLoss
from fxshard.compiler import cast_inputs
from fxshard.ir.context import DTYPES
from fxshard.runtime.mixed_precision import MasterWeightAdamW, split_masters
from fxshard.runtime.random import ReferenceDropout, begin_batch
from fxshard.train.optim import OptimConfig, clip_grad_norm_


def reference_losses(mf: ModelFile, steps: int, optim: OptimConfig = OptimConfig(), seed: int = 0,
                     dtype: str = "fp32", final_state: dict | None = None) -> list[float]:
    """Losses of ``steps`` AdamW steps on one device, from the same initial weights and batches.

    ``dtype="bf16"``: the same mixed-precision recipe as ``--dtype bf16`` (bf16 parameters and
    gradients, AdamW on fp32 master weights)."""
    model = mf.build_model(seed)
    model.train()
    batches = mf.batches(1, seed)
    positional = not isinstance(batches[0], dict)
    step_fn = _WithLoss(model, mf.loss_fn, positional)
    params = list(model.parameters())
    if dtype == "fp32":
        opt = optim.make(params)
    else:
        masters = split_masters(params, getattr(torch, DTYPES[dtype]))
        opt = MasterWeightAdamW(params, masters, optim)
    batches = mf.batches(steps * optim.grad_accum, seed)
    if dtype != "fp32":
        batches = [cast_inputs(b, getattr(torch, DTYPES[dtype])) for b in batches]
    losses = []
    for i in range(steps):
        total = 0.0
        for k, batch in enumerate(batches[i * optim.grad_accum:(i + 1) * optim.grad_accum]):
            begin_batch(seed, i * optim.grad_accum + k)  # dropout masks keyed as in fxshard.train.launch.train
            with ReferenceDropout():
                loss, _ = step_fn(*batch) if positional else step_fn(**batch)
            (loss / optim.grad_accum).backward()
            total += float(loss.detach())
        if optim.clip_grad_norm is not None and dtype != "fp32":
            clip_grad_norm_([(p.grad, 1.0) for p in params if p.grad is not None], optim.clip_grad_norm)
        elif optim.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad_norm, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / optim.grad_accum)
    if final_state is not None:  # the trained parameters by FQN (tied ones under every name)
        for name, p in model.named_parameters(remove_duplicate=False):
            final_state[name] = p.detach().clone()
    return losses
