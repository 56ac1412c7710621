"""Checks of the peers benchmark (``benchmarks/peers``).

The weight maps are pure tensor work and are checked anywhere: Megatron-Core's fused ``linear_qkv`` of each
tensor-parallel rank must hold exactly its own key/value groups (each group's query heads, then its key, then its
value), and torchtitan's q rows must be Hugging Face's rows in Meta's pair order.  The harness itself needs the
peers, which only ``make peers``' ``.venv-peers`` has; there, a toy tp2 run must give the three tools the same
losses from the same weights (no time is asserted)::

    .venv-peers/bin/python -m pytest -q benchmarks/test_peers.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.peers.weights import _unpermute, megatron_state  # noqa: E402

PEERS = all(importlib.util.find_spec(p) is not None for p in ("torchtitan", "megatron"))


def _hf(heads=8, kv_heads=4, d=4, hidden=32, ffn=48, layers=2) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(64, hidden, generator=g),
           "model.norm.weight": torch.randn(hidden, generator=g),
           "lm_head.weight": torch.randn(64, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": torch.randn(heads * d, hidden, generator=g),
                p + "self_attn.k_proj.weight": torch.randn(kv_heads * d, hidden, generator=g),
                p + "self_attn.v_proj.weight": torch.randn(kv_heads * d, hidden, generator=g),
                p + "self_attn.o_proj.weight": torch.randn(hidden, heads * d, generator=g),
                p + "mlp.gate_proj.weight": torch.randn(ffn, hidden, generator=g),
                p + "mlp.up_proj.weight": torch.randn(ffn, hidden, generator=g),
                p + "mlp.down_proj.weight": torch.randn(hidden, ffn, generator=g),
                p + "input_layernorm.weight": torch.randn(hidden, generator=g),
                p + "post_attention_layernorm.weight": torch.randn(hidden, generator=g)}
    return out


def test_megatron_qkv_rank_holds_its_own_groups():
    heads, kv, d, tp = 8, 4, 4, 2
    hf = _hf(heads, kv, d)
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    for rank in range(tp):
        state = megatron_state(hf, heads, kv, tp, rank, range(1, 2), first=False, last=True)
        rows = state["decoder.layers.0.self_attention.linear_qkv.weight"].split(d)  # one head's rows each
        per = heads // kv
        for j, group in enumerate(range(rank * kv // tp, (rank + 1) * kv // tp)):
            block = rows[j * (per + 2):(j + 1) * (per + 2)]
            for h in range(per):
                assert torch.equal(block[h], q[(group * per + h) * d:(group * per + h + 1) * d])
            assert torch.equal(block[per], k[group * d:(group + 1) * d])
            assert torch.equal(block[per + 1], v[group * d:(group + 1) * d])
        fc1 = state["decoder.layers.0.mlp.linear_fc1.weight"]
        gate, up = fc1.chunk(2)
        assert torch.equal(gate, hf["model.layers.1.mlp.gate_proj.weight"].chunk(tp)[rank])
        assert torch.equal(up, hf["model.layers.1.mlp.up_proj.weight"].chunk(tp)[rank])
        assert "embedding.word_embeddings.weight" not in state and "output_layer.weight" in state


def test_torchtitan_rows_are_meta_pairs():
    """Hugging Face's rotate-half rows (first halves, then second halves of each head) back to adjacent pairs."""
    heads, d = 2, 4
    w = torch.arange(heads * d, dtype=torch.float32)[:, None]  # row i holds i
    # per head, Hugging Face's rows [x0, x1 | y0, y1] are Meta's pairs (x0, y0), (x1, y1)
    assert _unpermute(w, heads).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not PEERS, reason="torchtitan and megatron-core are not installed here: run from make peers' "
                    ".venv-peers (.venv-peers/bin/python -m pytest benchmarks/test_peers.py)")
def test_peers_train_the_same_losses_at_tp2(tmp_path, monkeypatch):
    from benchmarks.models.peer_llama import SIZE_VARIABLE
    from benchmarks.peers.bench import run_layout
    from benchmarks.peers.common import LAYOUTS

    monkeypatch.setenv(SIZE_VARIABLE, "toy")
    result = run_layout(LAYOUTS["tp2"], tmp_path, ["fxshard", "torchtitan", "Megatron-Core"], rounds=2, warmup=0,
                        memory_steps=0, log=lambda *a: None)
    assert result["failed"] == {}, result["tracebacks"]
    ours = result["losses"]["fxshard"]
    assert len(ours) == 2
    for tool in ("torchtitan", "Megatron-Core"):
        assert result["losses"][tool] == pytest.approx(ours, rel=1e-5), tool


def test_a_rerun_layout_replaces_its_own_and_keeps_the_others_with_their_run():
    """``--only peers --layout dp2-replicated``: the file keeps every other layout, each naming the run that measured
    it, in the layouts' order."""
    from benchmarks.peers.bench import with_earlier_layouts

    earlier = {"command": "python -m benchmarks.run --only peers", "environment": {"date": "2026-12-02 04:30:13 UTC"},
               "peers": {"size": "small",
                         "layouts": [{"layout": n, "old": True} for n in ("tp2", "dp2", "pp2", "tp2dp2")]}}
    results = {"command": "python -m benchmarks.run --only peers --layout dp2-replicated",
               "peers": {"size": "small", "layouts": [{"layout": "dp2-replicated", "old": False}]}}
    merged = with_earlier_layouts(results, earlier)["peers"]
    assert [r["layout"] for r in merged["layouts"]] == ["tp2", "dp2", "dp2-replicated", "pp2", "tp2dp2"]
    assert merged["size"] == "small" and not merged["layouts"][2]["old"] and "measured" not in merged["layouts"][2]
    assert all(r["measured"] == {"command": earlier["command"], "date": "2026-12-02 04:30:13 UTC"}
               for r in merged["layouts"] if r["layout"] != "dp2-replicated")
    with pytest.raises(SystemExit, match="FXSHARD_PEERS_SIZE=small, this run toy"):
        with_earlier_layouts({**results, "peers": {**results["peers"], "size": "toy"}}, earlier)
