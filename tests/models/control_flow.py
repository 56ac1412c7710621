"""Data-dependent Python control flow: torch.export cannot capture it; fxshard specializes it on the example batch
(behind a runtime guard) when the weights are real, and refuses it under --meta."""

import torch
import torch.nn as nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            return y.mean()
        return -y.mean()


def make_model():
    return Branchy()


def make_inputs():
    return (torch.randn(2, 8),)
