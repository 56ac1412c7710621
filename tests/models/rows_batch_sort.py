"""Rows mixed by a sort over the batch: each example's loss weighted by its rank among the batch's losses (hardest
examples first, as curriculum and hard-example mining do), ``argsort(argsort(losses, dim=0))``.  Computed on the whole
batch under --dp, refused under pipeline microbatches."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, BATCH, SEQ = 64, 16, 4, 6


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.mlp(self.embed(input_ids)))
        per_example = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)
        rank = torch.argsort(torch.argsort(per_example.detach(), dim=0), dim=0)
        return (per_example * (1 + rank.float() / per_example.shape[0])).mean()


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
