"""Random ops in a training forward besides dropout, one per block: ``randn`` noise of the activations' size,
``randn_like``, a ``randperm`` of the tokens, a ``bernoulli_`` token mask, stochastic depth (timm's drop path: one
``bernoulli_`` per example), ``exponential_`` Gumbel noise and a ``multinomial`` draw of each token's expert.  Under
every layout each rank draws its elements of one device's values (fxshard.runtime.draws); before, fxshard refused
them under --dp and --pp."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, BATCH, SEQ, EXPERTS = 64, 16, 4, 8, 4


def drop_path(x, p: float):
    keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc_in = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc_out = nn.Linear(4 * HIDDEN, HIDDEN)
        self.gate = nn.Linear(HIDDEN, EXPERTS)

    def forward(self, h):
        b, s, d = h.shape
        x = self.norm(h) + 0.1 * torch.randn(b, s, d, device=h.device)
        x = self.fc_in(x)
        x = x * (1 + 0.05 * torch.randn_like(x))
        x = x[:, torch.randperm(s, device=h.device)].sort(dim=1).values  # a permutation of each example's tokens
        tokens = torch.empty(b, s, 1, device=h.device).bernoulli_(0.9)
        x = self.fc_out(F.gelu(x)) * tokens
        gumbel = -torch.empty(b, s, EXPERTS, device=h.device).exponential_().log()
        probs = F.softmax(self.gate(h) + gumbel, -1).reshape(b * s, EXPERTS)
        choice = torch.multinomial(probs, 1)  # each token's expert, drawn
        weight = 1 + probs.gather(1, choice).reshape(b, s, 1)
        return h + drop_path(x * weight, 0.2)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(4))  # 4: interleaved pp2 runs 2 stages a rank
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
