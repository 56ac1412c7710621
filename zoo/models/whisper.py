"""WhisperForConditionalGeneration: speech encoder-decoder, a front end of two 1-D convolutions (the second strided)
over log-mel features, sinusoidal encoder positions kept frozen (requires_grad=False). Tiny config, dropout 0; padded
targets labelled -100 on the pads."""

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from fxshard.testing import padded_batch, without_dropout


def make_model():
    config = WhisperConfig(vocab_size=256, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=16, max_target_positions=32, pad_token_id=0,
                           decoder_start_token_id=1, eos_token_id=2, bos_token_id=1, attn_implementation="sdpa")
    return WhisperForConditionalGeneration(without_dropout(config))


def make_inputs():
    labels, mask = padded_batch(256, 0, 8, lengths=(8, 2, 5, 3), first_id=3)
    return {"input_features": torch.randn(4, 16, 32), "labels": labels.masked_fill(mask == 0, -100), "use_cache": False}
