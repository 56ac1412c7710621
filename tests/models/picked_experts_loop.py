"""An eager experts loop, as DBRX's: over the experts the batch hit (``greater(mask.sum(), 0).nonzero()``, a loop
specialized at capture on how many and, for a split batch, which), ``torch.where`` numbers each expert's rows, the
expert (its slice of one fused weight) runs on the rows picked by those numbers, and ``index_add_`` writes each row's
result back by them.  Top-2 of 3 experts; each token's result is its own, so a split of the batch is exact
(tests/test_rows_picked.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

E, H, V, B, S = 3, 16, 32, 4, 8


class ExpertsLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.Parameter(torch.randn(E, H, H) / H**0.5)
        self.head = nn.Linear(H, V)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        flat = h.view(-1, H)
        top = self.router(flat).softmax(-1).topk(2, dim=-1)
        mask = F.one_hot(top.indices, E).permute(2, 1, 0)  # [E, 2, rows]
        out = torch.zeros_like(flat)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, rows = torch.where(mask[e].squeeze(0))
            y = (flat[rows] @ self.experts[e].squeeze(0)) * top.values[rows, slot, None]  # PICK
            out.index_add_(0, rows, y)
        logits = self.head(out.view(h.shape) + h)
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))


def make_model():
    torch.manual_seed(0)
    return ExpertsLoop()


def make_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, V, (B, S), generator=g)}
