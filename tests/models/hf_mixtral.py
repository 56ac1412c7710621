"""Hugging Face ``MixtralForCausalLM`` from a tiny config: its experts run through
``torch.ops.transformers.grouped_mm_fallback``, a custom op a transformers module registers, so every
place that runs a rank file must import that module first."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

BATCH, SEQ, VOCAB = 4, 16, 256


def make_model():
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64, router_jitter_noise=0.0,
                           attn_implementation="sdpa")
    return MixtralForCausalLM(config)


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
