"""A tiny LlamaForCausalLM that takes position_ids, so it trains on packed token files (``fxshard run --data PATH
--pack``): with position ids restarting per document, transformers masks attention to each document."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, SEQ = 4, 64


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=128, attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, 256, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ).repeat(BATCH, 1),
            "use_cache": False}
