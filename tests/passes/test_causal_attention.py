"""Tier 1: the causal-attention pass proves a mask built from positions alone causal, and keeps every other mask."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from fxshard.compiler import compile_program
from fxshard.ir.context import Layout
from fxshard.ir.sharding import argument

ROOT = Path(__file__).resolve().parents[2]
SDPA = torch.ops.aten.scaled_dot_product_attention.default

_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

S = 8


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 12)

    def forward(self, x):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        i = torch.arange(S)
{mask}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).pow(2).mean()


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(2, S, 4),)
'''

CAUSAL = {  # a mask equal to the causal triangle, however the model writes it
    "bool-le": "mask = i[None, :] <= i[:, None]",
    "tril": "mask = torch.ones(S, S, dtype=torch.bool).tril()",
    "additive": "mask = torch.zeros(S, S).masked_fill(i[None, :] > i[:, None], float('-inf'))",
}
KEPT = {  # a mask that is not, or that reads an input
    "sliding-window": "mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)",
    "anti-causal": "mask = i[None, :] >= i[:, None]",
    "from-input": "mask = (i[None, :] <= i[:, None]) & (x[:, None, :, 0] > -9)[:, :, None, :]",
}


def _attention(tmp_path: Path, mask: str):
    path = tmp_path / "model.py"
    path.write_text(_MODEL.format(mask=textwrap.indent(mask, " " * 8)))
    gm = compile_program(path, Layout()).gm
    return next(n for n in gm.graph.nodes if n.target is SDPA), gm


@pytest.mark.parametrize("mask", list(CAUSAL))
def test_a_causal_mask_from_positions_becomes_is_causal(tmp_path, mask):
    node, gm = _attention(tmp_path, CAUSAL[mask])
    assert argument(node, "is_causal") is True and argument(node, "attn_mask") is None
    assert not [n for n in gm.graph.nodes if getattr(n.meta.get("val"), "shape", ())[-2:] == (8, 8)]


@pytest.mark.parametrize("mask", list(KEPT))
def test_any_other_mask_is_kept(tmp_path, mask):
    node, _ = _attention(tmp_path, KEPT[mask])
    assert not argument(node, "is_causal") and argument(node, "attn_mask") is not None


def test_transformers_llama_attends_causally_with_no_sequence_squared_value():
    """samples/llama.py: transformers builds a [B, 1, S, S] mask from positions under capture; it is proven causal,
    and no value of the rank's program is S x S any more (the plan had 16*B*S**2 bytes saved)."""
    result = compile_program(ROOT / "samples" / "llama.py", Layout())
    nodes = [n for n in result.gm.graph.nodes if n.target is SDPA]
    assert len(nodes) == 4 and all(argument(n, "is_causal") and argument(n, "attn_mask") is None for n in nodes)
    assert not [n for n in result.gm.graph.nodes if getattr(n.meta.get("val"), "shape", ())[-2:] == (16, 16)]


def test_a_padding_mask_is_kept():
    """tests/models/llama_padded.py: the mask reads the batch's attention_mask, so it stays as the model wrote it."""
    result = compile_program(ROOT / "tests" / "models" / "llama_padded.py", Layout())
    nodes = [n for n in result.gm.graph.nodes if n.target is SDPA]
    assert nodes and all(argument(n, "attn_mask") is not None and not argument(n, "is_causal") for n in nodes)
