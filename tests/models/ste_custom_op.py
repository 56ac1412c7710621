"""The straight-through rounding of straight_through.py as a ``torch.library.custom_op`` whose autograd is
registered: the graph keeps the op, the rank files import this module, and the backward is the op's own."""

import torch


@torch.library.custom_op("fxshard_test::round_straight_through", mutates_args=())
def round_straight_through(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x * 4) / 4


@round_straight_through.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad  # straight through: the gradient of the identity, not of round (0)


round_straight_through.register_autograd(_backward)
