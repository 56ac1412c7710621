"""Attention with 6 heads: tp=4 cannot split them."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, hidden=48, heads=6):
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.ModuleDict({k: nn.Linear(hidden, hidden) for k in "qkv"})
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (self.qkv[n](x).view(b, s, self.num_heads, -1).transpose(1, 2) for n in "qkv")
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x):
        return self.attn(x).pow(2).mean()


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(2, 4, 48),)
