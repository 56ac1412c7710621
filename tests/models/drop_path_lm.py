"""A token-wise LM with stochastic depth (one ``bernoulli_`` per example), noise of the hidden size (``randn(H)``,
the same for every token) and noise of the activations' size (``randn(B, S, H)``): none splits a draw along the
sequence, so under ``--cp`` each rank takes its tokens of one device's draws (the batch-row analysis and
fxshard.runtime.draws under dp and microbatches)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, BATCH, SEQ = 64, 16, 4, 8


def drop_path(x, p):
    keep = x.new_empty((x.shape[0], 1, 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc_out = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, h):
        x = self.fc_out(F.gelu(self.fc_in(h + 0.1 * torch.randn(HIDDEN))))
        return h + drop_path(x, 0.3) + 0.1 * torch.randn(h.shape[0], h.shape[1], HIDDEN)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
