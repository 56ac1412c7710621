"""A decoder-shaped LM whose router reshapes its ``[B*S, E]`` logits with ``view(2, B*S, -1)`` and normalizes over the
leading 2: token t's routing weights then depend on token t + B*S/2, a token of another row of the batch.  A dp rank
(or a pipeline microbatch) holds half the rows, so its view pairs other tokens: 2.1e-4 off one device at dp2 and pp2
before fxshard tracked the rows through views (issue 43).  Under --dp the router is computed on the whole batch;
under pipeline microbatches the compile is refused, naming the view."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, EXPERTS, BATCH, SEQ = 64, 16, 4, 4, 8


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))

    def forward(self, h):
        b, s, d = h.shape
        flat = h.reshape(b * s, d)
        logits = self.gate(flat)
        paired = logits.view(2, b * s, -1).softmax(dim=0)  # the mix: dim 0 pairs token t with token t + b*s/2
        weights = paired.view(b * s, -1)
        out = sum(weights[:, e:e + 1] * self.experts[e](flat) for e in range(EXPERTS))
        return h + out.view(b, s, d)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Router() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
