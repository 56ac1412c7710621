"""ELECTRA's discriminator loss in small: a binary cross entropy averaged over the tokens the attention mask keeps,
``F.binary_cross_entropy_with_logits(logits[mask], labels[mask].float())``, rows keeping 16, 3, 9 and 5 tokens.
Each part of the batch keeps its own number, so a mean of the parts' means is not the batch's mean."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN = 32, 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, idx, attention_mask, labels):
        h = self.embed(idx)
        logits = self.head(h + self.mlp(h)).squeeze(-1)
        active = attention_mask.view(-1, idx.shape[1]) == 1
        return F.binary_cross_entropy_with_logits(logits.view(-1, idx.shape[1])[active], labels[active].float())


def make_model():
    return Model()


def make_inputs():
    mask = torch.zeros(4, 16, dtype=torch.long)
    for row, length in enumerate((16, 3, 9, 5)):
        mask[row, :length] = 1
    return {"idx": torch.randint(0, VOCAB, (4, 16)), "attention_mask": mask, "labels": torch.randint(0, 2, (4, 16))}
