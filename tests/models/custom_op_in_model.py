"""A model that registers its own custom op in the model file: rank files run without the model file,
so fxshard refuses it at compile and says to move the registration into an importable module."""

import torch
import torch.nn as nn


@torch.library.custom_op("fxshard_test::scale_by_two", mutates_args=())
def scale_by_two(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@scale_by_two.register_fake
def _(x):
    return torch.empty_like(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return scale_by_two(self.fc(x))


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 8),)


def loss_fn(out, inputs):
    return out.pow(2).mean()
