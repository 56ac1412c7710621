"""Rows mixed by a cumulative sum over the batch: each example adds the running sum of the examples before it
(``h.cumsum(0)``), so a part of the batch starts its sum where one device is partway through.  Computed on the whole
batch under --dp, refused under pipeline microbatches."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, BATCH, SEQ = 64, 16, 4, 6


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        h = h + 0.1 * self.proj(h).cumsum(0)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
