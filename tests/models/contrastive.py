"""A CLIP-shaped contrastive model: an image tower and a text tower project their examples into one space, and the
loss scores every image against every text of the batch (``logits = image @ text.T``, labels ``arange(B)``).  Each
example's loss depends on every other example: under --dp the features are gathered over the ranks (open_clip's
gathered features), so each rank computes the whole batch's logits."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, EMBED = 32, 16, 8


class Contrastive(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(3 * 4 * 4, HIDDEN)
        self.image_mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.image_proj = nn.Linear(HIDDEN, EMBED, bias=False)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.text_mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.text_proj = nn.Linear(HIDDEN, EMBED, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, pixel_values, input_ids):
        b = pixel_values.shape[0]
        patches = pixel_values.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, 48)
        image = self.image_mlp(self.patch(patches)).mean(1)
        text = self.text_mlp(self.embed(input_ids)).mean(1)
        image = F.normalize(self.image_proj(image), dim=-1)
        text = F.normalize(self.text_proj(text), dim=-1)
        logits = self.logit_scale.exp() * image @ text.t()
        labels = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def make_model():
    return Contrastive()


def make_inputs():
    return {"pixel_values": torch.randn(4, 3, 8, 8), "input_ids": torch.randint(0, VOCAB, (4, 6))}
