"""The CTC loss as one operator whose result's shape does not depend on the data.

``aten._ctc_loss`` returns, beside the loss, its forward variables sized by the longest target of the batch: a
shape only the data decides, which torch.export's fake tensors refuse (``DynamicOutputShapeException``), so a
CTC head (wav2vec2's ``Wav2Vec2ForCTC``) cannot be captured.  Its loss has a known shape ([batch] or a scalar),
so capture calls this op instead (``fxshard.capture.losses``) and rank files call the same; importing
``fxshard.runtime`` registers it.  Its gradient is the one autograd takes of ``F.ctc_loss`` on the same inputs,
recomputed in backward (one more CTC forward per step)::

    loss = torch.ops.fxshard.ctc_loss(log_probs, targets, input_lengths, target_lengths, 0, "mean", False)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("fxshard::ctc_loss", mutates_args=())
def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor, blank: int, reduction: str, zero_infinity: bool) -> torch.Tensor:
    """``F.ctc_loss`` with the same arguments (the lengths as tensors).

    >>> ctc_loss(torch.randn(6, 2, 5).log_softmax(2), torch.tensor([1, 2, 3]), torch.tensor([6, 6]),
    ...          torch.tensor([2, 1]), 0, "mean", False).shape
    torch.Size([])
    """
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity).clone()


@ctc_loss.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    batch = log_probs.shape[1:2] if log_probs.dim() == 3 else ()
    return log_probs.new_empty(batch if reduction == "none" else ())


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.options = inputs[4:]


def _backward(ctx, grad):
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    with torch.enable_grad():
        leaf = log_probs.detach().requires_grad_(True)
        loss = F.ctc_loss(leaf, targets, input_lengths, target_lengths, *ctx.options)
        (grad_log_probs,) = torch.autograd.grad(loss, leaf, grad)
    return grad_log_probs, None, None, None, None, None, None


ctc_loss.register_autograd(_backward, setup_context=_setup)
