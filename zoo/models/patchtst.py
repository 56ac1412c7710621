"""PatchTSTForPrediction: a time-series forecaster, each input series scaled by its own mean and standard deviation
(over time, per row and channel), cut into overlapping patches (unfold), encoded channel-independently (the channels
folded into the batch) and projected to a 4-step forecast; a mean squared error. Tiny config, dropout 0; 4 series of 3
channels, 32 steps each."""

import torch
from transformers import PatchTSTConfig, PatchTSTForPrediction

from fxshard.testing import without_dropout


def make_model():
    config = PatchTSTConfig(num_input_channels=3, context_length=32, patch_length=8, patch_stride=4,
                            prediction_length=4, d_model=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64,
                            scaling="std")
    return PatchTSTForPrediction(without_dropout(config))


def make_inputs():
    return {"past_values": torch.randn(4, 32, 3), "future_values": torch.randn(4, 4, 3)}
