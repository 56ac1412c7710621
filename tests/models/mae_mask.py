"""A masked autoencoder's patch mask (ViT-MAE, time-series pretraining): each example draws ``torch.rand(B, L)``, keeps
the patches of its smallest noise (``argsort``), encodes them, and reconstructs every patch from the kept ones
through the inverse permutation; the loss is over the masked patches.  Under --dp and pipeline microbatches each rank
draws its rows of one device's noise (fxshard.runtime.draws); before, fxshard refused it there."""

import torch
import torch.nn as nn

BATCH, PATCHES, PATCH, HIDDEN, KEEP = 4, 8, 12, 16, 4


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(PATCH, HIDDEN)
        self.pos = nn.Parameter(torch.randn(1, PATCHES, HIDDEN) * 0.02)
        self.mlp = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(),
                                 nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, patches):
        b, n, _ = patches.shape
        x = self.embed(patches) + self.pos
        noise = torch.rand(b, n, device=x.device)  # one number per patch of each example
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :KEEP]
        kept = torch.gather(x, 1, ids_keep.unsqueeze(-1).repeat(1, 1, HIDDEN))
        mask = torch.ones(b, n, device=x.device)
        mask[:, :KEEP] = 0
        mask = torch.gather(mask, 1, ids_restore)
        return kept + self.mlp(kept), mask, ids_restore


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(1, 1, HIDDEN))
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, PATCH))

    def forward(self, kept, ids_restore):
        b, n = ids_restore.shape
        tokens = torch.cat([kept, self.mask_token.repeat(b, n - kept.shape[1], 1)], dim=1)
        tokens = torch.gather(tokens, 1, ids_restore.unsqueeze(-1).repeat(1, 1, HIDDEN))
        return self.mlp(tokens)


class MAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()

    def forward(self, patches):
        kept, mask, ids_restore = self.encoder(patches)
        pred = self.decoder(kept, ids_restore)
        loss = (pred - patches).pow(2).mean(-1)
        return (loss * mask).sum() / mask.sum()  # the masked patches: as many in every example


def make_model():
    return MAE()


def make_inputs():
    return (torch.randn(BATCH, PATCHES, PATCH),)
