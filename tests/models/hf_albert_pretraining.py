"""AlbertForPreTraining: a masked LM loss (a mean over the masked tokens, a few per row, none in one) plus a
sentence-order loss (a mean over the examples): two means, each weighted by its own count over the step.  The two
batches mask 9 and 4 tokens, so --grad-accum 2 weighs the masked LM's tokens by the step's count."""

import torch
from transformers import AlbertConfig, AlbertForPreTraining

from fxshard.testing import masked_lm_batch, without_dropout

MASKED = [(5, 1, 0, 3), (0, 2, 1, 1)]


def make_model():
    return AlbertForPreTraining(without_dropout(AlbertConfig(
        vocab_size=128, embedding_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")))


def _batch(masked):
    return masked_lm_batch(128, pad=0, mask_id=3, masked=masked) | {"sentence_order_label": torch.tensor([0, 1, 1, 0])}


def make_inputs():
    return _batch(MASKED[0])


def make_batches():
    return [_batch(m) for m in MASKED]
