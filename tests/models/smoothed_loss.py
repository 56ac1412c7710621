"""A language-model head whose loss uses label smoothing, which the vocab-parallel cross entropy does not do."""

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

    def forward(self, idx, targets):
        logits = self.head(self.norm(self.embed(idx)))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), label_smoothing=0.1)


def make_model():
    return Model()


def make_inputs():
    data = torch.randint(0, VOCAB, (2, 9))
    return {"idx": data[:, :-1].contiguous(), "targets": data[:, 1:].contiguous()}
