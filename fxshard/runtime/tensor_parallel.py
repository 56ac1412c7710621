"""Local (communication-free) pieces of tensor-parallel layers."""

from __future__ import annotations

import torch


def _local_ids(ids: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids - start, outside)``: indices into this rank's rows ``[start, end)``, 0 where ``outside`` them."""
    outside = (ids < start) | (ids >= end)
    return (ids - start).masked_fill(outside, 0), outside


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, end: int,
                    padding_idx: int = -1) -> torch.Tensor:
    """Look up ids that fall in this rank's rows ``[start, end)``; other ids give zeros.

    The result is a partial sum over the tensor-parallel group: all-reduce it to get the embedding.
    ``padding_idx``: the padding row's index among this rank's rows (-1 where this rank does not hold it);
    its row gets no gradient, as in the unsplit ``aten.embedding``.
    """
    local, outside = _local_ids(ids, start, end)
    out = torch.ops.aten.embedding.default(weight, local, padding_idx)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the vocab-parallel cross entropy reduces in: fp32, or fp64 for fp64 logits."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _LocalLogSumExp(torch.autograd.Function):
    """``logsumexp`` over the last dim whose gradient is 0, not NaN, on a row that is all ``-inf`` (a rank
    whose classes are all masked: its share of the softmax is 0)."""

    @staticmethod
    def forward(ctx, x):
        lse = torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(x, lse)
        return lse

    @staticmethod
    def backward(ctx, grad):
        x, lse = ctx.saved_tensors
        share = torch.exp(x - lse.unsqueeze(-1)).masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0)
        return share.mul_(grad.unsqueeze(-1))


def vocab_cross_entropy_parts(logits: torch.Tensor, target: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """This rank's share of a cross entropy over classes ``[start, end)`` of ``logits`` ``[N, C/tp]``.

    Per token, two numbers (shape ``[N, 1, 2]``, to be all-gathered along dim 1): the logsumexp of this
    rank's logits, and the target's logit if this rank holds the target's class (else 0).  They are
    computed in fp32 (fp64 for fp64 logits) whatever the logits' dtype, as Megatron-LM's cross entropy is
    by default.
    """
    x = logits.to(reduction_dtype(logits.dtype))
    local, outside = _local_ids(target, start, end)
    picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return torch.stack([_LocalLogSumExp.apply(x), picked], dim=-1).unsqueeze(1)


def vocab_cross_entropy(parts: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                        reduction: str = "mean", dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cross entropy from every rank's :func:`vocab_cross_entropy_parts` gathered (``[N, tp, 2]``).

    ``logsumexp`` over the ranks' logsumexps is the logsumexp over all classes; the target's logit is
    the sum of the ranks' parts (one holds it).  ``ignore_index`` and ``reduction`` mean what they do in
    ``torch.nn.functional.cross_entropy``; the loss is computed in the parts' dtype and returned in
    ``dtype`` (the logits' dtype; default: the parts').
    """
    loss = torch.logsumexp(parts[..., 0], dim=1) - parts[..., 1].sum(dim=1)
    ignored = target == ignore_index
    loss = loss.masked_fill(ignored, 0.0)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / (~ignored).sum()
    return loss if dtype is None else loss.to(dtype)
