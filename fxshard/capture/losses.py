"""Losses torch.export cannot trace as they are, captured as one operator of ``fxshard.runtime``.

``F.ctc_loss`` (wav2vec2's CTC head) runs ``aten._ctc_loss``, whose auxiliary outputs are sized by the data;
while capturing, it calls ``torch.ops.fxshard.ctc_loss`` (``fxshard/runtime/ctc.py``), which computes the same
loss and gradient and whose result's shape is known::

    with traceable_losses():
        ep = torch.export.export(wrapper, args, kwargs, strict=False)
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import fxshard.runtime.ctc  # noqa: F401  registers torch.ops.fxshard.ctc_loss


@contextlib.contextmanager
def traceable_losses():
    original = F.ctc_loss

    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
        if not all(isinstance(t, torch.Tensor) for t in (log_probs, targets, input_lengths, target_lengths)):
            return original(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        return torch.ops.fxshard.ctc_loss(log_probs, targets, input_lengths, target_lengths, int(blank),
                                          str(reduction), bool(zero_infinity))

    F.ctc_loss = ctc_loss
    try:
        yield
    finally:
        F.ctc_loss = original
