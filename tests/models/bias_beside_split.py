"""A row-parallel Linear (bias added after the reduce) whose output is added to a column-parallel output: the sum
needs the reduced output split along the hidden size, which the bias spans (it is added whole, then split)."""
import torch
import torch.nn as nn

import fxshard


@fxshard.parallelize(a=fxshard.colwise(), b=fxshard.rowwise(), c=fxshard.colwise())
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        y = self.b(torch.relu(self.a(x))) + self.c(x)
        return y.pow(2).mean()


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 8),)
