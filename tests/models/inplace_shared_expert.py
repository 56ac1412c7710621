"""A mixture-of-experts-shaped block that adds its shared expert's output in place (`out.add_(shared(x))`) onto the
row-parallel partial sums of its routed path (P(sum) under a plan splitting up and down): the in-place add is
functionalized, the partial sums reduced first."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, H, FF, E = 32, 16, 32, 4


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.up = nn.Linear(H, FF, bias=False)
        self.down = nn.Linear(FF, H, bias=False)
        self.shared = nn.Linear(H, H)

    def forward(self, x):
        w = F.softmax(self.gate(x), dim=-1)
        out = self.down(F.silu(self.up(x)) * w[..., :1])
        out.add_(self.shared(x))
        return out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.moe = Moe()
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, idx, targets):
        h = self.embed(idx)
        h = h + self.moe(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def make_model():
    return Model()


def make_inputs():
    data = torch.randint(0, VOCAB, (4, 9))
    return {"idx": data[:, :-1].contiguous(), "targets": data[:, 1:].contiguous()}
