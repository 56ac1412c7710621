"""samples/gpt.py at its smallest (2 blocks of width 32): the model the --compile tests compile, since
inductor on two shared CPU cores takes seconds per graph."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = 64, 8, 32, 2, 2, 4


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
    def __init__(self, vocab=VOCAB, seq=SEQ, hidden=HIDDEN, heads=HEADS, layers=LAYERS, tied=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("fc_out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def make_model():
    return GPT()


def _batch(data):
    return {"idx": data[:, :SEQ].contiguous(), "targets": data[:, 1:].contiguous()}


def make_inputs():
    return _batch(torch.randint(0, VOCAB, (BATCH, SEQ + 1)))


def make_batches():
    return [_batch(torch.randint(0, VOCAB, (BATCH, SEQ + 1))) for _ in range(3)]


def loss_fn(output, inputs):
    logits, loss = output
    return loss
