"""Batch normalizations capture cannot hold as one device runs them, refused before capture, by module.

``nn.BatchNorm*d(momentum=None)`` keeps a cumulative average of the batch statistics: each step torch computes its
factor as ``1.0 / float(self.num_batches_tracked)``, a Python number read from a buffer.  torch.export cannot trace
that read (it stopped with "data-dependent control flow" on the line calling the model, naming nothing); a capture
that fixed the number at its first value would update the running statistics with factor 1 at every step, which no
loss shows and which evaluation then reads.  The fix is a float momentum::

    check_batch_norms(model, Path("model.py"))   # ModelFileError: bn: BatchNorm1d(momentum=None) keeps ...
"""

from __future__ import annotations

from pathlib import Path

import torch

from fxshard.errors import ModelFileError


def check_batch_norms(model: torch.nn.Module, path: Path) -> None:
    """Refuse a batch normalization in training mode that averages its statistics cumulatively."""
    for fqn, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is None and m.track_running_stats:
            raise ModelFileError(
                f"{path}: {fqn or 'the model'}: {type(m).__name__}(momentum=None) keeps a cumulative average of the "
                "batch statistics, whose factor torch reads each step as a Python number (1 / num_batches_tracked), "
                "which torch.export cannot capture and which, fixed at capture, would make the running statistics "
                f"wrong after the first step; give it a float momentum ({type(m).__name__}({m.num_features}, "
                "momentum=0.1), torch's default)")
