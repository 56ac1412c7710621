"""A loss that picks the counted tokens by boolean indexing, ``F.cross_entropy(logits[mask], labels[mask])``: the
number of rows depends on the data (``aten.nonzero``), so the compile's per-rank shape check carries it as a symbol."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN = 32, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx, labels):
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        mask = labels != -100
        return F.cross_entropy(logits[mask], labels[mask])


def make_model():
    return Model()


def make_inputs():
    idx = torch.randint(0, VOCAB, (4, 8))
    labels = torch.randint(0, VOCAB, (4, 8))
    labels[0, 5:] = -100  # the parts of the batch count 5 + 8, 8 + 2 tokens
    labels[3, 2:] = -100
    return {"idx": idx, "labels": labels}
