"""In-place updates the loss depends on without consuming their result: a write through a view
(``h[:, 0].zero_()``, then ``h`` is read) and a buffer counter (``calls.add_(1)``).  Training must run
them, in their place: at pp=1 before anything returns, and in whichever pipeline stage holds them."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        h = self.fc_in(x) + 1
        h[:, 0].zero_()
        return x + self.fc_out(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        self.calls.add_(1)
        for block in self.blocks:
            x = block(x)
        return x


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 16),)


def loss_fn(out, inputs):
    return out.pow(2).mean()
