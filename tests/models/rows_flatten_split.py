"""Rows mixed by flattening the batch's tokens, ``flatten(0, 1)``, then splitting them at another size than a row: the
first third of the batch's tokens goes through one linear, the rest through another, so which linear a token meets
depends on the rows beside it.  Computed on the whole batch under --dp, refused under pipeline microbatches."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, BATCH, SEQ = 64, 16, 4, 6


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.first = nn.Linear(HIDDEN, HIDDEN)
        self.rest = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        tokens = h.flatten(0, 1)
        n = tokens.shape[0] // 3
        first, rest = tokens.split([n, tokens.shape[0] - n])
        mixed = torch.cat([self.first(first), self.rest(rest)]).view_as(h)
        return F.cross_entropy(self.head(h + mixed).flatten(0, 1), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
