"""straight_through.py with its Function in an importable module (tests/models/ste_function.py) and a
non-tensor argument: capture runs it as a custom op whose backward is the Function's own (identity), so it
trains as on one device; forward and backward are elementwise, so it splits with the MLP over tp."""

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ste_function, as an installed package would be

from ste_function import RoundStraightThrough  # noqa: E402


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        return x + self.fc_out(RoundStraightThrough.apply(torch.relu(self.fc_in(x)), 4.0))


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
