"""HubertForSequenceClassification: a speech encoder pooled by averaging each row over its own length (the padding mask
of the convolutional features, `hidden_states[~padding_mask] = 0.0`, divided by each row's count), classified into 3
labels. Tiny config, dropout and layer drop 0; audio rows of 400, 300, 150 and 400 samples."""

import torch
from transformers import HubertConfig, HubertForSequenceClassification

from fxshard.testing import without_dropout


def make_model():
    config = HubertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                          num_conv_pos_embedding_groups=4, num_labels=3, mask_time_prob=0.0, feat_extract_norm="layer",
                          do_stable_layer_norm=True)
    return HubertForSequenceClassification(without_dropout(config))


def make_inputs():
    mask = torch.ones(4, 400, dtype=torch.long)
    mask[1, 300:] = 0
    mask[2, 150:] = 0
    return {"input_values": torch.randn(4, 400) * mask, "attention_mask": mask, "labels": torch.tensor([0, 2, 1, 1])}
