"""SwinForImageClassification: windowed attention over a patch grid, the windows shifted (torch.roll) every other block
with an attention mask between regions, a learned relative position bias table gathered by index, and patch merging (a
2x2 neighbourhood concatenated and projected) between stages; a 10-way classification loss. Tiny config, windows of 2,
dropout and stochastic depth 0."""

import torch
from transformers import SwinConfig, SwinForImageClassification

from fxshard.testing import without_dropout


def make_model():
    config = SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=32, depths=[2, 1], num_heads=[2, 4],
                        window_size=2, mlp_ratio=2.0, num_labels=10)
    return SwinForImageClassification(without_dropout(config))


def make_inputs():
    return {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.randint(0, 10, (4,))}
