"""A tiny LlamaForCausalLM trained from ``make_dataset(split)``: a map-style dataset of 22 training rows (so a
batch of 4 straddles epochs) and 8 validation rows, each row a deterministic function of its index.

``STREAM=1`` in the environment makes the training split an IterableDataset of the same rows, in order.
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, SEQ, VOCAB = 4, 16, 256
ROWS = {"train": 22, "validation": 8}


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def row(split: str, i: int) -> dict:
    g = torch.Generator().manual_seed(1000 * (split == "validation") + i)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


class Rows(torch.utils.data.Dataset):
    def __init__(self, split):
        self.split = split

    def __len__(self):
        return ROWS[self.split]

    def __getitem__(self, i):
        return row(self.split, i)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, split):
        self.split = split

    def __iter__(self):
        return (row(self.split, i) for i in range(ROWS[self.split]))


def make_dataset(split):
    return Stream(split) if os.environ.get("STREAM") == "1" and split == "train" else Rows(split)
