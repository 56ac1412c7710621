"""straight_through.py with its Function written as a ``torch.library.custom_op`` with ``register_autograd``
(tests/models/ste_custom_op.py): the backward survives capture, so it trains as on one device."""

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ste_custom_op, as an installed package would be

from ste_custom_op import round_straight_through  # noqa: E402


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        return x + self.fc_out(round_straight_through(torch.relu(self.fc_in(x))))


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
