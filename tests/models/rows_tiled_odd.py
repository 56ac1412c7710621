"""A table of two rows tiled over three slots per row of the batch (``w[:2].repeat(3 * B // 2, 1).view(B, 3, d)``):
row b's slots are ``w[(3b + j) % 2]``, so odd rows start with the table's second row.  A part of the batch would
start its tiling again at ``w[0]``: the value is computed on the whole batch under --dp and each rank keeps its rows
(``rt.own_rows``, in the layer class).  Before, that class lacked ``self.dp`` and the run failed; a pipeline, which
sees one microbatch at a time, refuses it."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, BATCH, SEQ = 64, 16, 4, 8


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2, HIDDEN) * 0.1)
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h):
        b, s, d = h.shape
        slots = self.table.repeat(3 * b // 2, 1).view(b, 3, d)  # row b: w[(3b + j) % 2], j = 0, 1, 2
        return h + self.fc(torch.tanh(h + slots.sum(1, keepdim=True)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
