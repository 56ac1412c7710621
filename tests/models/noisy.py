"""Randomness other than dropout in training: multiplicative noise from ``torch.rand_like`` (as Phimoe's
jitter and router sampling draw).  Under every layout each rank draws its elements of one device's values
(fxshard.runtime.draws)."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        h = torch.relu(self.fc_in(x))
        if self.training:
            h = h * (0.9 + 0.2 * torch.rand_like(h))
        return x + self.fc_out(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 16),)


def loss_fn(out, inputs):
    return out.pow(2).mean()
