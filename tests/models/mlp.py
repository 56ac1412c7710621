"""Two Linears with an activation between them: Megatron's MLP (1 all-reduce forward, 1 backward)."""

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
        self.norm = nn.LayerNorm(16)  # so the MLP's input needs a gradient, as inside a network
        self.mlp = MLP()

    def forward(self, x):
        return self.mlp(self.norm(x))


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 16),)


def loss_fn(out, inputs):
    return out.pow(2).mean()
