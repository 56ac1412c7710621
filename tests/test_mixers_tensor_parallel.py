"""State-space mixers split over tp by the rules of their ops, and key/value heads fewer than tp (issue 31, sections
1 and 2), train as one device does.

transformers' Mamba-2 (the chunked scan of its torch path) at tp=2 with one group (B and C whole on every rank, the
gated norm's variance summed over the ranks) and with two (B and C split by group, the norm local), and at tp=4;
Mamba-1 (the selective scan) at tp=2.  Each is compiled with the automatic plan, trained for 3 AdamW steps on real
gloo process groups through ``fxshard.train.launch.train`` (what ``fxshard run`` runs on each rank), and compared
with single-device training: losses within 1e-5 relative, the trained parameters within ``fxshard verify``'s share
of the update (1e-3).  The manifest shows every mixer parameter split and each rank holding at most 55% of the
model's parameters.

A Llama with 2 key/value heads at tp=4 and GPT-BigCode with one (multi-query, a fused ``c_attn``) at tp=2 hold each
key/value head on tp/kv ranks (``S(0)/2``; ``8/1`` blocks whole on every rank), the replicas' gradients summed once
per layer (``rt.sum_replicas``): trained against one device the same way, with the plan lines saying so.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from harness import assert_matches_single_device, compile_and_train, single_device

from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import read_manifest
from fxshard.ir.layout import TP, Layout
from fxshard.ir.placement import Replicate
from fxshard.testing import case_result, matrix, selected_cases
from fxshard.train.optim import OptimConfig

MODELS = Path(__file__).resolve().parent / "models"
MAMBA2, MAMBA2_GROUPS, MAMBA = MODELS / "hf_mamba2.py", MODELS / "hf_mamba2_groups.py", MODELS / "hf_mamba.py"
KV2, MQA = MODELS / "hf_llama_kv2.py", MODELS / "hf_gpt_bigcode_mqa.py"
STEPS = 3
REL = 1e-5
CASES = {
    "mamba2-tp2": (MAMBA2, Layout(tp=2)),
    "mamba2-groups2-tp2": (MAMBA2_GROUPS, Layout(tp=2)),
    "mamba2-tp4": (MAMBA2, Layout(tp=4)),
    "mamba-tp2": (MAMBA, Layout(tp=2)),
    "llama-kv2-tp4": (KV2, Layout(tp=4)),
    "gpt-bigcode-mqa-tp2": (MQA, Layout(tp=2)),
}
MIXERS = [c for c in CASES if c.startswith("mamba")]
KEEP = ("mamba2-groups2-tp2", "mamba2-tp4", "mamba-tp2", "llama-kv2-tp4", "gpt-bigcode-mqa-tp2")  # make test's
# the mixer parameters: every one split over tp (none left whole on every rank)
MIXER = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "out_proj.weight")
MIXER2 = ("dt_bias", "norm.weight")
MIXER1 = ("x_proj.weight", "dt_proj.weight", "dt_proj.bias")


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory):
    return compile_and_train({case: (*CASES[case], OptimConfig()) for case in selected_cases(request, CASES)},
                             tmp_path_factory, STEPS)


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_mixer_training_matches_single_device(trained, case):
    path, layout = CASES[case]
    per_rank, manifest = case_result(trained, case)
    want, single = single_device(path, STEPS, OptimConfig())
    assert_matches_single_device(case, path, layout, per_rank, manifest, want, single, REL)


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(MIXERS, [c for c in MIXERS if c in KEEP]))
def test_every_mixer_parameter_is_split_and_a_rank_holds_at_most_55_percent(trained, case):
    path, layout = CASES[case]
    _, manifest = case_result(trained, case)
    total = sum(p.numel() for p in load_model_file(path).build_model(0).parameters())
    names = MIXER + (MIXER1 if path == MAMBA else MIXER2)
    for entry in manifest.ranks:
        params = {t.source: t for t in entry.tensors.values() if t.kind == "parameter"}
        mixer = {fqn: t for fqn, t in params.items() if ".mixer." in fqn}
        assert {fqn.split(".mixer.")[1] for fqn in mixer} == set(names), case
        whole = [fqn for fqn, t in mixer.items() if t.placements[TP] == Replicate()]
        assert not whole, f"{case}: mixer parameters left whole on tp rank {entry.coords.tp}: {whole}"
        held = sum(math.prod(t.shape) for t in params.values())
        assert held <= 0.55 * total, f"{case}: tp rank {entry.coords.tp} holds {held} of {total} parameters"


@pytest.mark.distributed
@pytest.mark.parametrize("case,held", [("llama-kv2-tp4", "k_proj.weight S(0)/2, v_proj.weight S(0)/2"),
                                       ("gpt-bigcode-mqa-tp2", "c_attn.weight S(0)[32,8/1,8/1]")])
def test_key_value_heads_held_by_several_ranks_say_so(trained, case, held):
    _, manifest = case_result(trained, case)
    notes = [n for n in manifest.notes if "rt.sum_replicas" in n]
    assert len(notes) == 1 and held in notes[0], manifest.notes
    for entry in manifest.ranks:
        assert sum(c.op == "sum_replicas" for c in entry.collectives) == 2  # one per layer


@pytest.mark.distributed
def test_weight_shards_hold_each_key_value_head_once_assembled(tmp_path):
    """The compile's weight shards are the manifest's slices of the model's tensors: rank r of tp=4 holds the k/v
    rows of head r // 2, and the slices assembled (what export and a reshard read) give each head once."""
    from safetensors.torch import load_file

    from fxshard.driver import compile as compile_model
    from fxshard.runtime.slices import assemble

    compile_model(KV2, Layout(tp=4), out=tmp_path)
    manifest = read_manifest(tmp_path)
    model = dict(load_model_file(KV2).build_model(0).named_parameters())
    pieces: dict = {}
    for entry in manifest.ranks:
        state = load_file(str(tmp_path / entry.weights))
        for key, t in entry.tensors.items():
            if t.kind != "parameter":
                continue
            pieces.setdefault(t.source, []).append((t.slice, state[key]))
            if t.source == "model.layers.0.self_attn.k_proj.weight":
                head = entry.coords.tp // 2
                assert torch.equal(state[key], model[t.source][8 * head:8 * (head + 1)]), entry.coords
    for fqn, parts in pieces.items():
        assert torch.equal(assemble(parts, model[fqn].shape), model[fqn]), fqn
