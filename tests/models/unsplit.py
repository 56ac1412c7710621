"""An MLP that tp splits beside a projection no rule splits (no column/row pair: 16 -> 15 features) and a norm:
12% of the parameters stay whole on every tp rank, which the compile says."""

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        return self.fc_out(torch.relu(self.fc_in(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = MLP()
        self.proj = nn.Linear(16, 15)

    def forward(self, x):
        return self.proj(self.mlp(self.norm(x))).pow(2).mean()


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 8, 16),)
