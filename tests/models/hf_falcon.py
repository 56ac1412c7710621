"""Hugging Face ``FalconForCausalLM`` from a tiny config: its attention slices the fused qkv with an
index list made in forward (``fused_qkv[..., [-2], :]``), which torch.export lifts as a constant."""

import torch
from transformers import FalconConfig, FalconForCausalLM

BATCH, SEQ, VOCAB = 4, 16, 256


def make_model():
    config = FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                          hidden_dropout=0.0, attention_dropout=0.0, attn_implementation="eager")
    return FalconForCausalLM(config)


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
