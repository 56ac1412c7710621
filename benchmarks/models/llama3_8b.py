"""Llama-3.1-8B-shaped LlamaForCausalLM (32 layers of 4096, SwiGLU 14336, 32 heads over 8 key/value heads,
vocabulary 128256): for `fxshard plan` only (captured on meta tensors, nothing allocated)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, 128256, (16, 32))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
