"""samples/llama.py trained from ``make_dataset(split)``: 30 training rows (so a batch of 4 straddles epochs within
12 steps) and 8 validation rows, the first rows of samples/own_loop.py's seeded corpus, so that loop and
``fxshard run --no-shuffle`` read the same batches."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, SEQ, VOCAB = 4, 16, 256
ROWS = {"train": (0, 30), "validation": (512, 520)}


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def make_dataset(split):
    ids = torch.randint(0, VOCAB, (1024, SEQ), generator=torch.Generator().manual_seed(1234))  # own_loop's corpus
    first, end = ROWS[split]
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(first, end)]
