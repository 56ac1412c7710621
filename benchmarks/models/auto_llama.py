"""A small Llama (4 layers of 256, 8 heads over 4 key/value heads, SwiGLU 704, vocabulary 1024) at batch 8 x
sequence 128: the model the auto benchmark predicts and measures at world size 4 on the CPU (big enough that its
matrix products, not Python's dispatch, are most of a step; small enough to train twelve layouts in minutes)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, SEQ, VOCAB = 8, 128, 1024


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=SEQ, attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
