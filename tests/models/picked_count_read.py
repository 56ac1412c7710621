"""The count of the rows a mask selects read as a Python number (``int(mask.sum())``) and used in arithmetic: capture
specializes it on the example batch, whose two halves count alike, so each part's check holds; but each part reads its
own count (6), one device the whole batch's (12) (tests/test_rows_picked.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, B, S = 32, 16, 4, 8


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.head = nn.Linear(H, V)

    def forward(self, input_ids, labels):
        flat = self.embed(input_ids).view(-1, H)
        even = input_ids.view(-1) % 2 == 0
        rows = torch.where(even)[0]
        n = int(even.sum())  # read as a number: each part reads its own count
        out = flat.index_add(0, rows, flat[rows] * 8 / n)
        return F.cross_entropy(self.head(out), labels.view(-1))


def make_model():
    torch.manual_seed(0)
    return M()


def make_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, S), generator=g).repeat(2, 1)  # both halves alike: each part counts the same
    return {"input_ids": ids, "labels": torch.randint(0, V, (B, S), generator=g)}
