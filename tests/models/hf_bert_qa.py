"""BertForQuestionAnswering: extractive QA's start and end cross entropies, whose ignore_index is the sequence length
(a position past the sequence is clamped to it and not counted), averaged: two means over counted positions, each
divided by its own count over the step.  The two batches count different positions (2 and 3 of 4, then 3 and 1),
so --grad-accum 2 weighs them by their counts.  The bias of qa_outputs shifts every position's logit alike, so its
gradient is zero up to rounding: test with a large AdamW eps, whose update follows the gradient's scale."""

import torch
from transformers import BertConfig, BertForQuestionAnswering

from fxshard.testing import padded_batch, without_dropout

POSITIONS = [([3, 16, 7, 40], [5, 16, 9, 2]), ([1, 4, 2, 30], [16, 20, 17, 6])]  # 16 and past: no answer


def make_model():
    return BertForQuestionAnswering(without_dropout(BertConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")))


def _batch(start, end):
    ids, mask = padded_batch(128, pad=0)
    return {"input_ids": ids, "attention_mask": mask, "start_positions": torch.tensor(start),
            "end_positions": torch.tensor(end)}


def make_inputs():
    return _batch(*POSITIONS[0])


def make_batches():
    return [_batch(*p) for p in POSITIONS]
