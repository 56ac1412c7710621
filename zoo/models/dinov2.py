"""Dinov2ForImageClassification: patch convolution, layer scale, a classifier over the class token and the mean of the
patch tokens. A vision model has no padding; its loss is a mean over images."""

import torch
from transformers import Dinov2Config, Dinov2ForImageClassification

from fxshard.testing import without_dropout


def make_model():
    return Dinov2ForImageClassification(without_dropout(Dinov2Config(image_size=24, patch_size=8, num_channels=3,
                                                                     hidden_size=64, mlp_ratio=2, num_hidden_layers=2,
                                                                     num_attention_heads=4, num_labels=10,
                                                                     attn_implementation="sdpa")))


def make_inputs():
    return {"pixel_values": torch.randn(4, 3, 24, 24), "labels": torch.randint(0, 10, (4,))}
