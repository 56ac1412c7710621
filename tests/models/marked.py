"""A residual MLP stack whose forward marks its own pipeline cuts (after layers 0 and 2 of 4: three
stages) and carries a long skip connection from the input projection to the head, which crosses
every stage."""

import torch
import torch.nn as nn

import fxshard


class Layer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, hidden=16, layers=4):
        super().__init__()
        self.proj = nn.Linear(8, hidden)
        self.layers = nn.ModuleList(Layer(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, y):
        skip = self.proj(x)
        h = skip
        for i, layer in enumerate(self.layers):
            if i in (1, 3):
                fxshard.pipeline_split()
            h = layer(h)
        pred = self.head(h + skip).squeeze(-1)
        return torch.nn.functional.mse_loss(pred, y)


def make_model():
    return Net()


def make_inputs():
    return (torch.randn(8, 8), torch.randn(8))


def make_batches():
    return [make_inputs() for _ in range(3)]
