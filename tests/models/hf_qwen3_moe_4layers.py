"""Hugging Face ``Qwen3MoeForCausalLM`` from a tiny config with 4 layers (interleaved pipeline schedules: 2 stages
per pp rank at pp=2, a layer each).  Its own plan splits the experts
(``moe_tp_experts``, ``packed_colwise`` on 3-D expert weights; ``ep_dispatch_experts`` / ``grouped_gemm`` in
its expert-parallel plan) and names dense-MLP modules this configuration does not have."""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

BATCH, SEQ, VOCAB = 4, 8, 128


def make_model():
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=32, pad_token_id=1,
                            attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(config)


def make_inputs():
    ids = torch.randint(2, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
