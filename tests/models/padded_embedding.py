"""Two vocab-parallel lookups with padding rows, one held by each of 2 tp ranks (row 1 and row 50 of 64),
with those pad ids in the batch: single-device training gives the padding rows no gradient."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(64, 16, padding_idx=1)
        self.tag = nn.Embedding(64, 16, padding_idx=50)
        self.head = nn.Linear(16, 8)

    def forward(self, ids, tags, target):
        h = self.tok(ids) + self.tag(tags)
        return F.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), target.flatten())


def make_model():
    model = Model()
    return fxshard.parallelize(model, tok=fxshard.vocab_parallel(), tag=fxshard.vocab_parallel(),
                               head=fxshard.replicate())


def make_inputs():
    ids = torch.randint(0, 64, (4, 6))
    ids[:, -2:] = 1  # padding, right-aligned
    tags = torch.randint(0, 64, (4, 6))
    tags[:, :2] = 50
    return {"ids": ids, "tags": tags, "target": torch.randint(0, 8, (4, 6))}
