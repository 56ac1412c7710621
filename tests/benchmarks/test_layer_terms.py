"""benchmarks/layer_terms.py restates, term by term, what fxshard's program keeps of one Llama layer (checked here
against the plan's own trace, fxshard.cost.saved) and what Megatron-LM's formula charges for it."""

from __future__ import annotations

import pytest

from benchmarks.layer_terms import formula_layer, fxshard_layer
from benchmarks.megatron_memory import MegatronConfig, layer_activation_bytes
from fxshard.cost.costs import S
from fxshard.cost.profile import T, b


def test_the_formulas_terms_add_up_to_megatrons_layer():
    cfg = MegatronConfig(layers=80, hidden=8192, ffn=28672, heads=64, groups=8, vocab=128256, tp=4, seq=8192)
    assert sum(formula_layer(8192, 28672, 8192, 4).values()) == layer_activation_bytes(cfg)  # 512 MiB


def test_fxshards_terms_are_what_its_program_saves(llama_bf16_profile):
    """The restatement is the trace: the bytes autograd saves in one layer of the sample compiled with --sp (and
    without), as the profile (what plan --auto and the recipes page use) holds them, at two sizes and two tp
    (samples/llama.py: hidden 64, ffn 128, 8 heads, 4 kv heads)."""
    profile = llama_bf16_profile
    traced = profile.pieces("sp")["block0"].saved["none"]
    for rows, seq, tp in ((2, 16, 2), (1, 64, 4)):
        ours = fxshard_layer(hidden=64, ffn=128, heads=8, kv_heads=4, seq=seq, tp=tp, rows=rows)
        assert float(traced.subs({b: rows, S: seq, T: tp})) == pytest.approx(sum(ours.values()))
    tp_only = profile.pieces("tp")["block0"].saved["none"]
    ours = fxshard_layer(hidden=64, ffn=128, heads=8, kv_heads=4, seq=16, tp=2, rows=2, sp=False)
    assert float(tp_only.subs({b: 2, S: 16, T: 2})) == pytest.approx(sum(ours.values()))
