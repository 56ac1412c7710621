"""ResNetForImageClassification: batch normalization in training mode, its statistics over the whole batch; under
--dp they are gathered over the ranks (SyncBatchNorm's semantics)."""

import torch
from transformers import ResNetConfig, ResNetForImageClassification


def make_model():
    return ResNetForImageClassification(ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=10))


def make_inputs():
    return {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.randint(0, 10, (4,))}
