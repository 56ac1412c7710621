"""Hugging Face ``GptOssForCausalLM`` from a tiny config: its experts interleave gate and up columns (sliced with a step
between the grouped matmuls) and carry biases, which ``moe_tp_experts`` refuses to split (its own plan does not ask)."""

import torch
from transformers import GptOssConfig, GptOssForCausalLM

VOCAB = 128


def make_model():
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=32, attn_implementation="eager",
                          layer_types=["full_attention"])
    return GptOssForCausalLM(config)


def make_inputs():
    ids = torch.randint(0, VOCAB, (2, 8))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
