"""The typed manifest (``fxshard/codegen/manifest.py``): folders compiled before it existed still read, the JSON
it writes is what fxshard wrote before, and a manifest that is not fxshard's is refused at the read.

``tests/fixtures/manifests`` holds manifest.json files written by fxshard before the manifest was typed
(commit c150d36): ``falcon-tp2`` (collectives only returning the logits need, tied weights), ``falcon-tp2-pp2-meta``
(pipeline stages and tables, a weight tied across stages, ``--meta``: tensors read from no shard) and
``straight-through-op-tp2`` (a custom op the rank files import).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxshard.codegen.manifest import Manifest, TiedWeight, WeightsSource, read_manifest
from fxshard.compiler import compile as compile_model
from fxshard.errors import OutputFolderError
from fxshard.ir.context import Layout

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "manifests"
MLP = ROOT / "tests" / "models" / "mlp.py"


def _fixture(name: str) -> Manifest:
    return Manifest.from_json(json.loads((FIXTURES / f"{name}.json").read_text()))


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_a_manifest_written_before_reads_and_writes_back_the_same_bytes(name):
    text = (FIXTURES / f"{name}.json").read_text()
    assert Manifest.from_json(json.loads(text)).dumps() == text


def test_the_fixtures_read_as_typed_records():
    tp = _fixture("falcon-tp2")
    assert tp.layout == Layout(tp=2) and tp.pipeline is None and tp.weights is None
    assert [c.op for c in tp.ranks[0].collectives if c.outputs_only] == ["all_gather"]
    assert any(t.aliases for t in tp.ranks[0].tensors.values())
    assert set(tp.digests) == {"rank_pp0_tp0.py", "rank_pp0_tp1.py", "model.py"}

    meta = _fixture("falcon-tp2-pp2-meta")
    entry = meta.rank({"pp": 1, "tp": 0})
    assert entry.global_ranks == (2,) and [s.class_name for s in entry.stages] == ["Stage1"]
    assert {c.stage for c in entry.collectives} == {1}
    assert meta.tied_across_stages == (TiedWeight("tied:lm_head.weight", "lm_head.weight", (0, 1)),)
    assert [r.stage for r in meta.pipeline.table] == [0, 1]
    assert meta.weights == WeightsSource(None, {})
    params = {k: t for k, t in entry.tensors.items() if t.kind == "parameter"}
    assert params and all(not t.in_shard and t.checkpoint is None for t in params.values())  # read from nowhere
    assert entry.read_at_run_time == {k: t.shape for k, t in entry.tensors.items() if not t.in_shard}

    ops = _fixture("straight-through-op-tp2")
    assert ops.custom_ops == {"fxshard_test::round_straight_through": "ste_custom_op"}


def test_a_compile_round_trips_through_its_json(tmp_path):
    result = compile_model(ROOT / "tests" / "models" / "marked.py", Layout(pp=3), out=tmp_path)
    assert read_manifest(tmp_path) == result.manifest
    assert (tmp_path / "manifest.json").read_text() == result.manifest.dumps()


def test_keys_older_fxshards_did_not_write_take_their_defaults():
    data = json.loads((FIXTURES / "falcon-tp2.json").read_text())
    for key in ("dtype", "virtual_stages"):
        del data["layout"][key]
    del data["custom_ops"], data["digests"]
    old = Manifest.from_json(data)
    assert old.layout == Layout(tp=2) and old.custom_ops == {} and old.digests is None


def test_sp_is_written_only_when_set_and_reads_back():
    data = json.loads((FIXTURES / "falcon-tp2.json").read_text())
    assert "sp" not in data["layout"]  # manifests from before --sp keep their bytes
    assert Manifest.from_json(data).layout.sp is False
    layout = Layout(tp=2, sp=True, recompute="selective")
    assert layout.to_json()["sp"] is True and Layout.from_json(layout.to_json()) == layout
    assert "sp" not in Layout(tp=2).to_json()


def test_a_manifest_missing_a_key_is_refused_when_read(tmp_path):
    compile_model(MLP, Layout(tp=2), out=tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    del data["ranks"][0]["global_ranks"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(OutputFolderError, match=r"not an fxshard manifest of format 1; recompile with this fxshard "
                                                r"\(KeyError: 'global_ranks'\)"):
        read_manifest(tmp_path)
