"""A top-k over the sequence: ``pool`` keeps each row's 4 highest-scoring tokens, so a token's result depends on the
other tokens of its row (context parallelism must refuse it, naming ``pool``), beside a top-k over the features that
every token computes on its own."""

import torch
from torch import nn

BATCH, SEQ, VOCAB, HIDDEN = 2, 16, 64, 16


class TopTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(HIDDEN, 1)

    def forward(self, h):
        scores = self.score(h).squeeze(-1)                       # [B, S]
        top = scores.topk(4, dim=1).values                      # along the sequence: mixes tokens
        return top.sum()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.pool = TopTokens()

    def forward(self, input_ids):
        h = self.proj(self.embed(input_ids))
        h = h + h.topk(2, dim=-1).values.sum(-1, keepdim=True)   # along the features: each token its own
        return self.pool(h)


def make_model():
    return Model()


def make_inputs():
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ))}
