"""The typed manifest (``fxshard/codegen/manifest.py``): the JSON reads back as typed records and writes back the same
bytes; a folder of an older format is refused with "recompile" (and may be compiled over), and a manifest that is not
fxshard's is refused at the read.

``tests/fixtures/manifests`` holds manifest.json files fxshard wrote (commit c150d36, as format 1), turned into
format 2 (typed placements per mesh axis) by replacing each tensor's ``placement`` text and ``axis``:
``falcon-tp2`` (collectives only returning the logits need, tied weights), ``falcon-tp2-pp2-meta`` (pipeline stages
and tables, a weight tied across stages, ``--meta``: tensors read from no shard) and ``straight-through-op-tp2`` (a
custom op the rank files import).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxshard.codegen.manifest import Manifest, TensorEntry, TiedWeight, WeightsSource, read_manifest
from fxshard.driver import compile as compile_model
from fxshard.errors import OutputFolderError
from fxshard.ir.layout import TP, Coords, Layout
from fxshard.ir.placement import Replicate, Shard

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "manifests"
MLP = ROOT / "tests" / "models" / "mlp.py"


def _fixture(name: str) -> Manifest:
    return Manifest.from_json(json.loads((FIXTURES / f"{name}.json").read_text()))


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_a_manifest_reads_and_writes_back_the_same_bytes(name):
    text = (FIXTURES / f"{name}.json").read_text()
    assert Manifest.from_json(json.loads(text)).dumps() == text


def test_the_fixtures_read_as_typed_records():
    tp = _fixture("falcon-tp2")
    assert tp.layout == Layout(tp=2) and tp.pipeline is None and tp.weights is None
    assert [c.op for c in tp.ranks[0].collectives if c.outputs_only] == ["all_gather"]
    assert any(t.aliases for t in tp.ranks[0].tensors.values())
    assert set(tp.digests) == {"rank_pp0_tp0.py", "rank_pp0_tp1.py", "model.py"}

    meta = _fixture("falcon-tp2-pp2-meta")
    entry = meta.rank(Coords(pp=1))
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
    with pytest.raises(OutputFolderError, match=r"not an fxshard manifest of format 2; recompile with this fxshard "
                                                r"\(KeyError: 'global_ranks'\)"):
        read_manifest(tmp_path)


def test_placements_are_typed_per_mesh_axis():
    tp = _fixture("falcon-tp2")
    lm_head = next(t for e in tp.ranks for t in e.tensors.values() if t.source == "lm_head.weight")
    assert lm_head.placements == {TP: Shard(0)} and lm_head.axis == TP and lm_head.placement == Shard(0)
    qkv = next(t for t in tp.ranks[1].tensors.values() if t.source.endswith("query_key_value.weight"))
    assert isinstance(qkv.placements[TP], (Shard, Replicate))
    assert TensorEntry.from_json(qkv.to_json()) == qkv


def test_a_placement_fxshard_does_not_write_is_refused_when_read(tmp_path):
    compile_model(MLP, Layout(tp=2), out=tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    next(iter(data["ranks"][0]["tensors"].values()))["placements"]["tp"] = "Shard(0)"  # format 1's text
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(OutputFolderError, match=r"format 2; recompile .*ValueError: 'Shard\(0\)' is not a placement"):
        read_manifest(tmp_path)


def test_a_folder_of_format_1_is_refused_with_recompile_and_can_be_compiled_over(tmp_path):
    """Format 1 stored each placement as ``repr`` text; this fxshard does not parse it back: it asks for a recompile,
    and a compile into that folder replaces it (the folder is still fxshard's)."""
    compile_model(MLP, Layout(tp=2), out=tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["format"] = 1
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(OutputFolderError, match=r"compiled by an older fxshard \(manifest format 1; .*recompile with "
                                                r"`fxshard compile MODEL.py --out "):
        read_manifest(tmp_path)
    compile_model(MLP, Layout(tp=2), out=tmp_path)
    assert read_manifest(tmp_path).ranks[0].tensors
