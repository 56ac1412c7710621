"""Hugging Face ``MixtralForCausalLM`` asking for ``experts_implementation="eager"``: its experts loop in Python over
the experts that received tokens, which torch.export cannot trace; fxshard captures it with the model's own
grouped-matmul experts (transformers' default), the same computation."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

BATCH, SEQ, VOCAB = 4, 16, 256


def make_model():
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64, router_jitter_noise=0.0,
                           attn_implementation="sdpa", experts_implementation="eager")
    return MixtralForCausalLM(config)


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
