"""Hugging Face ``PhimoeForCausalLM`` from a tiny config.  Its router multiplies through its own
``torch.autograd.Function`` (``PhimoeMultiplier``, kept as an fxshard_fn custom op) and, in training, samples
experts with ``exponential_`` / ``rand_like`` over the batch's flattened tokens: each rank draws its tokens' values
of one device's, under pipeline and data parallelism too (tests/test_rows_layouts.py)."""

import torch
from transformers import PhimoeConfig, PhimoeForCausalLM

BATCH, SEQ, VOCAB = 4, 16, 256


def make_model():
    config = PhimoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, attention_dropout=0.0,
                          attn_implementation="sdpa")
    return PhimoeForCausalLM(config)


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
