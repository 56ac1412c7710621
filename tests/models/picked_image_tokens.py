"""Image features put in place of image tokens, as Llava does: one feature row per patch, the images' features joined
back whole (``torch.cat(list(features))``: an unbind per image), the count of image tokens checked against the
features' size (``torch_compilable_check``, a runtime assertion), then ``masked_scatter`` into the token embeddings.
Each part of the batch scatters its own images into its own tokens where each part's check holds
(tests/test_rows_picked.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.utils.import_utils import torch_compilable_check

V, H, C, P, B, S, IMAGE = 32, 16, 12, 3, 4, 8, 31


class ImageTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.vision = nn.Linear(C, H)
        self.head = nn.Linear(H, V)

    def forward(self, input_ids, pixels, labels):
        features = torch.cat(list(self.vision(pixels)), dim=0)  # [B * P, H]
        mask = input_ids == IMAGE
        torch_compilable_check(mask.sum() * H == features.numel(), "image tokens and features differ")  # CHECK
        h = self.embed(input_ids).masked_scatter(mask.unsqueeze(-1), features)
        return F.cross_entropy(self.head(h).view(-1, V), labels.view(-1), ignore_index=-100)


def make_model():
    torch.manual_seed(0)
    return ImageTokens()


def make_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, IMAGE, (B, S), generator=g)
    ids[:, 1:1 + P] = IMAGE
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, 1:1 + P] = -100
    return {"input_ids": ids, "pixels": torch.randn(B, P, C, generator=g), "labels": labels}
