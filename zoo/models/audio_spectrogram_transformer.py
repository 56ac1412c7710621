"""ASTForAudioClassification: a spectrogram cut into overlapping 2-D patches by a strided convolution (frequency and
time), two prepended tokens (class and distillation) whose outputs are averaged for a 5-way classification loss. Tiny
config, dropout 0."""

import torch
from transformers import ASTConfig, ASTForAudioClassification

from fxshard.testing import without_dropout


def make_model():
    config = ASTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, patch_size=8,
                       frequency_stride=8, time_stride=8, max_length=32, num_mel_bins=16, num_labels=5)
    return ASTForAudioClassification(without_dropout(config))


def make_inputs():
    return {"input_values": torch.randn(4, 32, 16), "labels": torch.randint(0, 5, (4,))}
