"""The benchmarks' GPT: the architecture of samples/gpt.py, a plain nn.Module that knows nothing of parallelism.

One file serves every contender: fxshard compiles it, DTensor parallelizes an instance of
:class:`GPT`, the hand-written Megatron version loads its weights.  The size comes from the
environment (``tiny``, ``small``, ``medium``; default ``small``) so the file stays a model file::

    FXSHARD_BENCH_SIZE=medium fxshard compile benchmarks/models/gpt.py --tp 2 --out out/bench
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {  # name -> GPT keyword arguments and the batch
    "tiny": dict(vocab=128, seq=16, hidden=64, heads=4, layers=2, batch=2),
    "small": dict(vocab=1024, seq=128, hidden=256, heads=8, layers=4, batch=4),
    "medium": dict(vocab=2048, seq=128, hidden=512, heads=8, layers=4, batch=4),
}


def size() -> dict:
    return SIZES[os.environ.get("FXSHARD_BENCH_SIZE", "small")]


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q = self.q_proj(x).view(b, s, self.heads, h // self.heads).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.heads, h // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, an LM head tied to the token embedding."""

    def __init__(self, vocab, seq, hidden, heads, layers):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("fc_out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_model():
    config = dict(size())
    config.pop("batch")
    return GPT(**config)


def make_inputs():
    s = size()
    data = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1))
    return {"idx": data[:, :-1].contiguous(), "targets": data[:, 1:].contiguous()}
