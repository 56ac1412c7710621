"""Tensors made inside ``forward`` (an index list, a ``torch.tensor`` of values): torch.export lifts
them as constants of the graph (Falcon's ``fused_qkv[..., [-2], :]``, T5's ``_shift_right``).  They
travel with the program to every rank and stage that reads them."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 64)
        self.fc_out = nn.Linear(64, 16)

    def forward(self, x):
        h = self.fc_in(x)
        h = h * torch.tensor([0.5, 2.0]).repeat(32)  # a float constant made in forward
        h = h[..., [-1, 0] + list(range(1, 63))]  # an index list, lifted as an int64 constant
        return x + self.fc_out(torch.relu(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        x = x[:, [1, 0] + list(range(2, 16))]
        for block in self.blocks:
            x = block(x)
        return x


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 16),)


def loss_fn(out, inputs):
    return out.pow(2).mean()
