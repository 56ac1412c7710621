"""ViTMAEForPreTraining: a masked autoencoder, a random 75% of each image's patches hidden (`torch.rand` noise argsorted
per image: a random op other than dropout), the visible ones encoded and a light decoder reconstructing the pixels, the
loss averaged over the hidden patches. Tiny config, dropout 0; exact where every rank draws what one device draws for
it."""

import torch
from transformers import ViTMAEConfig, ViTMAEForPreTraining

from fxshard.testing import without_dropout


def make_model():
    config = ViTMAEConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, decoder_hidden_size=32,
                          decoder_intermediate_size=64, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
                          mask_ratio=0.75)
    return ViTMAEForPreTraining(without_dropout(config))


def make_inputs():
    return {"pixel_values": torch.randn(4, 3, 16, 16)}
