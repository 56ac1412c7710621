"""LongformerForMaskedLM: sliding-window attention with global tokens, chosen in Python by
`is_index_global_attn.flatten().any().item()` and sized by `nonzero()` (the data-dependent code capture specializes on
the example batch, each read a runtime guard naming the model's line). Tiny config, windows of 4, dropout 0; a padded
masked-LM batch, the first token of each row global."""

import torch
from transformers import LongformerConfig, LongformerForMaskedLM

from fxshard.testing import masked_lm_batch, without_dropout


def make_model():
    config = LongformerConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64, attention_window=[4, 4],
                              pad_token_id=0)
    return LongformerForMaskedLM(without_dropout(config))


def make_inputs():
    batch = masked_lm_batch(256, pad=0, mask_id=3)
    batch["global_attention_mask"] = torch.zeros_like(batch["input_ids"])
    batch["global_attention_mask"][:, 0] = 1
    return batch
