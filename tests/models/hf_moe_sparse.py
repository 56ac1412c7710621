"""Hugging Face ``Qwen3MoeForCausalLM`` with 16 experts, top-2, and a batch of 4 sequences of 4 tokens: split over
4 dp ranks, each rank routes 4 tokens x 2 = 8 (token, expert) pairs to 16 experts, so on every rank at least 8
experts get no token (grouped matmuls over empty groups; under --ep, exchanges with empty parts)."""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

BATCH, SEQ, VOCAB = 4, 4, 64


def make_model():
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=16,
                            num_experts_per_tok=2, max_position_embeddings=16, pad_token_id=1,
                            attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(config)


def make_inputs():
    ids = torch.randint(2, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
