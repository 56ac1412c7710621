"""Rows mixed by a reshape across batch and sequence: ``h.reshape(S, B, H)`` (where ``transpose(0, 1)`` was meant)
then a softmax over the new leading dimension, reshaped back: a token's weights pair it with tokens of other rows,
and a part of the batch reshapes other tokens together.  Computed on the whole batch under --dp, refused under
pipeline microbatches (the batch-row analysis, fxshard.ir.rows)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, BATCH, SEQ = 64, 16, 4, 6


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.score = nn.Linear(HIDDEN, HIDDEN, bias=False)  # a bias would not move a softmax over the rows
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        b, s, d = h.shape
        weights = self.score(h).reshape(s, b, d).softmax(dim=0).reshape(b, s, d)
        return F.cross_entropy(self.head(h * weights).flatten(0, 1), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
