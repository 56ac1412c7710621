"""A tiny LlamaForCausalLM for chat token files (``fxshard data tokenize --format chat``): a 512-id vocabulary
(the byte-level tokenizer ``fxshard data generate --chat`` trains), sequences of 128, and position_ids, so it
trains on conversations one per sequence (right-padded) or packed (``--pack``: each conversation its own
attention block)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, SEQ, VOCAB = 4, 128, 512


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ).repeat(BATCH, 1),
            "use_cache": False}
