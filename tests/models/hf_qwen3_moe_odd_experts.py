"""Hugging Face ``Qwen3MoeForCausalLM`` whose experts' intermediate size (6) tp=4 does not divide, everything else
splitting at tp=4: its own plan's ``moe_tp_experts`` must be refused with the degrees that work."""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

BATCH, SEQ, VOCAB = 2, 8, 128


def make_model():
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=6,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=32, pad_token_id=1,
                            attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(config)


def make_inputs():
    ids = torch.randint(2, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
