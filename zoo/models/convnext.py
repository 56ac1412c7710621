"""ConvNextForImageClassification: a convolutional net without batch norm, a 4x4 patchify stem, depthwise 7x7
convolutions, LayerNorm over channels (channels last), inverted-bottleneck MLPs as Linears, learned layer scale and
downsampling convolutions between stages; a 10-way classification loss. Tiny config (two stages), stochastic depth 0."""

import torch
from transformers import ConvNextConfig, ConvNextForImageClassification

from fxshard.testing import without_dropout


def make_model():
    config = ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[32, 64], depths=[1, 1],
                            num_labels=10, image_size=32)
    return ConvNextForImageClassification(without_dropout(config))


def make_inputs():
    return {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))}
