"""WavLMForXVector: a speaker-embedding head, TDNN layers (dilated 1-D convolutions) and statistics pooling (the mean
and standard deviation of each row over its own length, taken by a Python loop slicing `hidden_states[i, :length]`: a
size the data decides, an unbacked symbol of torch.export), an AM-softmax loss; the encoder has gated relative position
bias. Tiny config, dropout and layer drop 0; rows of 400, 300, 150 and 400 samples."""

import torch
from transformers import WavLMConfig, WavLMForXVector

from fxshard.testing import without_dropout


def make_model():
    config = WavLMConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=4, num_buckets=32, max_bucket_distance=64, num_labels=3,
                         mask_time_prob=0.0, tdnn_dim=(32, 32, 64), tdnn_kernel=(3, 3, 1), tdnn_dilation=(1, 2, 1),
                         xvector_output_dim=16, feat_extract_norm="layer", do_stable_layer_norm=True)
    return WavLMForXVector(without_dropout(config))


def make_inputs():
    mask = torch.ones(4, 400, dtype=torch.long)
    mask[1, 300:] = 0
    mask[2, 150:] = 0
    return {"input_values": torch.randn(4, 400) * mask, "attention_mask": mask, "labels": torch.tensor([0, 2, 1, 1])}
