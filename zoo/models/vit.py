"""ViTForImageClassification: patch embedding (a convolution), class token, a 10-way classification loss.
A vision model has no padding; its loss is a mean over images, which every split of the batch keeps equal."""

import torch
from transformers import ViTConfig, ViTForImageClassification

from fxshard.testing import without_dropout


def make_model():
    return ViTForImageClassification(without_dropout(ViTConfig(
        image_size=24, patch_size=8, num_channels=3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_labels=10, attn_implementation="sdpa")))


def make_inputs():
    return {"pixel_values": torch.randn(4, 3, 24, 24), "labels": torch.randint(0, 10, (4,))}
