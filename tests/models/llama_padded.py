"""LlamaForCausalLM on a right-padded batch: rows of 16, 3, 12 and 5 real tokens, pads labelled -100.

Single-device training divides the summed token losses by the 32 counted targets of the whole batch; a dp
rank or microbatch holding the short rows must not weigh its tokens more.  Two batches with other padding
let --grad-accum 2 count across batches.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ, PAD = 16, 0
LENGTHS = [(16, 3, 12, 5), (7, 16, 1, 9)]


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, pad_token_id=PAD, attn_implementation="sdpa"))


def _batch(lengths):
    ids = torch.randint(1, 256, (len(lengths), SEQ))
    mask = torch.zeros(len(lengths), SEQ, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100), "use_cache": False}


def make_inputs():
    return _batch(LENGTHS[0])


def make_batches():
    return [_batch(lengths) for lengths in LENGTHS]
