"""Wav2Vec2ForCTC: a convolutional feature encoder over raw audio, a convolutional relative position embedding
(weight-normed), and a CTC head whose loss checks `labels.max() >= vocab_size` in Python and gathers the targets with
`masked_select` (specialized at capture; the loss captured as fxshard::ctc_loss, whose shape does not depend on the
data). Tiny config, dropout and layer drop 0; label rows of 6, 4, 6 and 2 characters."""

import torch
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

from fxshard.testing import without_dropout


def make_model():
    config = Wav2Vec2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, pad_token_id=0,
                            mask_time_prob=0.0, ctc_loss_reduction="mean")
    return Wav2Vec2ForCTC(without_dropout(config))


def make_inputs():
    labels = torch.randint(1, 32, (4, 6))
    labels[1, 4:] = -100
    labels[3, 2:] = -100
    return {"input_values": torch.randn(4, 400), "labels": labels}
