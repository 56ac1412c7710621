"""A custom ``torch.autograd.Function`` whose backward is not its forward's gradient: a straight-through
estimator (forward rounds, backward passes the gradient unchanged), defined in the model file itself.  fxshard
keeps a Function's backward by defining it as a custom op in every rank file, which run without the model
file: it refuses this one at compile, naming the Function and module (straight_through_fn.py imports it)."""

import torch
import torch.nn as nn


class RoundStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        return x + self.fc_out(RoundStraightThrough.apply(torch.relu(self.fc_in(x))))


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
