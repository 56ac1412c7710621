"""Two MLPs back to back: the first's row-parallel output, its bias added after the all-reduce, feeds the
second's column-parallel input directly.  The added bias is a value the tensor-parallel pass inserts; the
gradient coming back into it is a partial sum, so it needs its ``copy_to`` like any replicated input."""

import torch
import torch.nn as nn

import fxshard


@fxshard.parallelize(a=fxshard.colwise(), b=fxshard.rowwise(), c=fxshard.colwise(), d=fxshard.rowwise())
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        self.c = nn.Linear(8, 16)
        self.d = nn.Linear(16, 8)

    def forward(self, x):
        return self.d(torch.relu(self.c(self.b(torch.relu(self.a(x)))))).pow(2).mean()


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 8),)
