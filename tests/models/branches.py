"""Two independent Megatron MLP branches of different widths, concatenated: two all-reduces of different
shapes that could be issued in either order (the static-check tests reorder them in one rank file)."""

import torch
import torch.nn as nn

import fxshard


@fxshard.parallelize(a_in=fxshard.colwise(), a_out=fxshard.rowwise(), b_in=fxshard.colwise(),
                     b_out=fxshard.rowwise())
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.a_in, self.a_out = nn.Linear(16, 32), nn.Linear(32, 8)
        self.b_in, self.b_out = nn.Linear(16, 32), nn.Linear(32, 24)

    def forward(self, x):
        h = self.norm(x)
        a, b = torch.relu(self.a_in(h)), torch.relu(self.b_in(h))
        return torch.cat([self.a_out(a), self.b_out(b)], dim=-1)


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 16),)


def loss_fn(out, inputs):
    return out.pow(2).mean()
