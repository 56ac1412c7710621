"""A classifier that averages its tokens (a mean over the sequence): under --cp each rank would hold a part of the
sequence the mean needs whole, which fxshard refuses by name (issue 45 item 13)."""

import torch


class SequenceMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, input_ids, labels):
        pooled = self.embed(input_ids).mean(dim=1)
        return torch.nn.functional.cross_entropy(self.head(pooled), labels)


def make_model():
    torch.manual_seed(0)
    return SequenceMean()


def make_inputs():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 32, (4, 16), generator=g), "labels": torch.randint(0, 4, (4,), generator=g)}
