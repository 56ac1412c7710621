"""Python that reads tensor values (fxshard.capture.specialize): a range check of the labels that raises, a branch on
``mask.any().item()``, a loop over the experts that received tokens (``nonzero()``) choosing each by an f-string of
its index, and a module converting itself to the dtype it has in every forward (Switch Transformers' router)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, EXPERTS = 16, 8, 2


class Experts(nn.ModuleDict):
    def __init__(self):
        super().__init__({f"expert_{i}": nn.Linear(HIDDEN, HIDDEN) for i in range(EXPERTS)})
        self.router = nn.Linear(HIDDEN, EXPERTS)

    def forward(self, h):
        self.router = self.router.to(torch.float32)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        hit = torch.bincount(choice, minlength=EXPERTS).nonzero()
        for expert in hit:
            rows = torch.where(choice == expert)[0]
            out = out.index_add(0, rows, self[f"expert_{expert[0]}"](h[rows]))
        return out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.experts = Experts()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx, flags, labels):
        if labels.max() >= VOCAB:
            raise ValueError("labels out of range")
        h = self.embed(idx).flatten(0, 1)
        if flags.any().item():
            h = h * 2
        h = h + self.experts(h)
        return F.cross_entropy(self.head(h), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    return {"idx": torch.arange(8).reshape(2, 4), "flags": torch.tensor([0, 1]),
            "labels": torch.arange(8).reshape(2, 4) % VOCAB}
