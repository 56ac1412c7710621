"""A model file that forgot make_model()."""

import torch


def make_inputs():
    return (torch.randn(2, 8),)
