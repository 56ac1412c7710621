"""Llama-3-70B-shaped LlamaForCausalLM (80 layers): for `fxshard plan` and `fxshard compile --meta` only (its
weights alone are 280 GB in fp32); both capture on meta tensors and allocate nothing."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        attn_implementation="sdpa"))


def make_inputs():  # dp=4 x 16 microbatches of one sequence; `fxshard plan --seq 4096` evaluates at the real length
    ids = torch.randint(0, 128256, (64, 32))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
