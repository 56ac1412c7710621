"""Rows mixed by a sum over the batch fed back into each row: ``h - h.sum(0) / B`` (a hand-written centering over the
batch, as a batch norm without the module).  Computed on the whole batch under --dp, refused under pipeline
microbatches."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, BATCH, SEQ = 64, 16, 4, 6


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)  # the centering over the batch would cancel a bias
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.proj(self.embed(input_ids))
        h = h - h.sum(0) / h.shape[0]
        return F.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
