"""A vocab-parallel lookup (a partial sum at tp > 1) read directly by a column-parallel Linear and by a
matmul with a split operand, with no norm between: the partial sum is reduced, nothing else gathered."""

import torch
import torch.nn as nn

import fxshard


@fxshard.parallelize(emb=fxshard.vocab_parallel(), proj=fxshard.colwise())
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, ids):
        x = self.emb(ids)  # [b, s, 16]
        a = self.proj(x).transpose(1, 2)  # [b, 8, s], split over its 8 rows
        return (a @ x).pow(2).mean()  # [b, 8, 16]


def make_model():
    return Model()


def make_inputs():
    return (torch.randint(0, 32, (2, 6)),)
