"""DeBERTa's disentangled attention, reduced: relative-position keys computed from parameters alone (``[H, 2L, dh]``)
are repeated over the batch (``pos.repeat(B, 1, 1)``: ``[B*H, 2L, dh]``, batch-major like the queries) and
multiplied with each row's queries.  Every row gets the same copy, so a part of the batch repeats the same keys
over its own rows: exact at --dp 2 and --pp 2.  Before, the repeat counted as mixing the rows (a copy of ``H``
rows is not one row): pipelines refused it, and --dp computed it on the whole batch in a layer class that lacked
``self.dp``, which failed at run (zoo's deberta_v2)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, SPAN, BATCH, SEQ = 64, 16, 4, 8, 4, 8


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.v = nn.Linear(HIDDEN, HIDDEN)
        self.pos_key = nn.Linear(HIDDEN, HIDDEN, bias=False)  # a bias would add the same to every key: no gradient
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h, rel):
        b, s, d = h.shape
        dh = d // HEADS
        q = self.q(h).view(b, s, HEADS, dh).transpose(1, 2).reshape(b * HEADS, s, dh)
        v = self.v(h).view(b, s, HEADS, dh).transpose(1, 2).reshape(b * HEADS, s, dh)
        pos = self.pos_key(rel).view(2 * SPAN, HEADS, dh).transpose(0, 1)  # [H, 2L, dh]: no row of the batch
        pos = pos.repeat(q.size(0) // HEADS, 1, 1)  # [B*H, 2L, dh], as DeBERTa-v2 writes it
        c2p = torch.bmm(q, pos.transpose(1, 2))[:, :, :s]  # [B*H, S, S]
        att = F.softmax(c2p / dh ** 0.5, dim=-1)
        ctx = torch.bmm(att, v).view(b, HEADS, s, dh).transpose(1, 2).reshape(b, s, d)
        return h + self.out(ctx)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rel = nn.Embedding(2 * SPAN, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, self.rel.weight)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def make_model():
    return Model()


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}
