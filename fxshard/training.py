"""Training settings shared by the distributed run and the single-device reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def kwargs(self) -> dict:
        # foreach=False: the per-tensor loop gives the same update for a tensor whether or not it is
        # sharded, so distributed and single-device runs agree to rounding
        return dict(lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps, weight_decay=self.weight_decay,
                    foreach=False)

    def make(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **self.kwargs())
