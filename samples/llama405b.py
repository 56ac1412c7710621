"""Llama-3-405B-shaped LlamaForCausalLM (126 layers): for `fxshard plan` and `fxshard compile --meta` only (its
weights alone are 1.6 TB in fp32); both capture on meta tensors and allocate nothing."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        attn_implementation="sdpa"))


def make_inputs():  # dp=8 x 16 microbatches of one sequence; `fxshard plan --seq 4096` evaluates at the real length
    ids = torch.randint(0, 128256, (128, 32))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
