"""A branch on a count over the whole batch against the batch's size (``mask.sum() == 2 * rows``), which the example
batch does not take: each half of it counts 2 and 6 image tokens against 4, the whole 8 against 8.  Each part of a
split batch checks its own count and takes the example's branch; one device takes the other
(tests/test_rows_picked.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, B, S, IMAGE = 32, 16, 4, 8, 31


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.head = nn.Linear(H, V)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        if (input_ids == IMAGE).sum() == 2 * input_ids.shape[0]:  # two image tokens a row, on average
            h = h * 2
        return F.cross_entropy(self.head(h).view(-1, V), labels.view(-1))


def make_model():
    torch.manual_seed(0)
    return M()


def make_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, IMAGE, (B, S), generator=g)
    ids[0, 1] = ids[1, 1] = IMAGE  # rows 0 and 1 one each, rows 2 and 3 three each: each half False, the whole True
    ids[2, 1:4] = ids[3, 1:4] = IMAGE
    return {"input_ids": ids, "labels": torch.randint(0, V, (B, S), generator=g)}
