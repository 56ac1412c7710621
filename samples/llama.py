"""Hugging Face ``LlamaForCausalLM`` from a small config (RoPE, RMSNorm, SwiGLU, grouped-query attention).

No download: the model is built from a config with random weights.  It ships its own tensor-parallel
plan (``base_model_tp_plan``), which fxshard uses.

    fxshard compile samples/llama.py --tp 2 --out out/llama
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, SEQ = 4, 16


def config():
    return LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        attn_implementation="sdpa",
    )


def make_model():
    return LlamaForCausalLM(config())


def make_inputs():
    ids = torch.randint(0, 256, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
