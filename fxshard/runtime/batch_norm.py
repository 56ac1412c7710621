"""Batch normalization over the whole batch when data-parallel ranks each hold a part of it (SyncBatchNorm's
semantics), as three lines of a rank file::

    stats = rt.batch_stats(x)                                   # [2, C]: this rank's per-channel mean and variance
    stats = rt.gather_to(stats, self.dp, dim=0)                 # [2 * dp, C]: every rank's, in dp order
    y = rt.batch_norm_from_stats(x, stats, weight, bias, running_mean, running_var, 0.1, 1e-05)

Every rank holds the same number of values per channel (the batch splits evenly), so the whole batch's mean is the
mean of the ranks' means and its variance the mean of (variance + (mean - whole mean)²) (Chan et al.'s combination).
Each rank normalizes its own rows with the whole batch's statistics and updates the running statistics with them, as
one device does (the running variance unbiased over all the batch's values), so the buffers stay identical on every
rank.  Backward flows through the gathered statistics: ``gather_to``'s reduce-scatter sums every rank's gradient of
each rank's statistics, which with the data-parallel average of the weights' gradients is one device's gradient
(``passes/batch_norm_sync.py``).  torch's ``SyncBatchNorm`` runs only on GPUs; this runs wherever the rank does.
"""

from __future__ import annotations

import torch


def _reduced(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def batch_stats(x: torch.Tensor) -> torch.Tensor:
    """This rank's per-channel (dimension 1) mean and biased variance over its other dimensions: ``[2, C]``."""
    dims = _reduced(x)
    mean = x.mean(dims)
    var = (x - _channels(mean, x)).square().mean(dims)
    return torch.stack([mean, var])


def _channels(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


def batch_norm_from_stats(x: torch.Tensor, stats: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                          running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                          eps: float) -> torch.Tensor:
    """Normalize ``x`` by the whole batch's statistics, combined from every rank's ``[mean, var]`` rows of ``stats``
    (rank r's at rows 2r and 2r + 1); update the running statistics in place as ``F.batch_norm`` does."""
    means, variances = stats[0::2], stats[1::2]
    mean = means.mean(0)
    var = (variances + (means - mean).square()).mean(0)
    if running_mean is not None and running_var is not None:
        count = x.numel() // x.shape[1] * means.shape[0]  # the values per channel in the whole batch
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    y = (x - _channels(mean, x)) * _channels(torch.rsqrt(var + eps), x)
    if weight is not None:
        y = y * _channels(weight, x)
    if bias is not None:
        y = y + _channels(bias, x)
    return y
