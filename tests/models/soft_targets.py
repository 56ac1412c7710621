"""A language-model head trained on class probabilities (soft targets), which the vocab-parallel cross entropy
does not take."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN = 32, 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx, soft):
        logits = self.head(self.norm(self.embed(idx)))
        return F.cross_entropy(logits.view(-1, VOCAB), soft.view(-1, VOCAB))


def make_model():
    return Model()


def make_inputs():
    return {"idx": torch.randint(0, VOCAB, (2, 8)), "soft": torch.softmax(torch.randn(2, 8, VOCAB), -1)}
