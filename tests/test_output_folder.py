"""Compiling into a folder never loses a file fxshard did not write, and a failed compile changes nothing.

Each test builds the real folder: a foreign manifest.json, a user's files next to a compiled program, a
symlinked model copy, a compile that fails half-way through writing.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from fxshard.codegen.manifest import read_manifest
from fxshard.compiler import compile as compile_model
from fxshard.errors import OutputFolderError, ShardingError
from fxshard.ir.context import Layout

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "samples" / "gpt.py"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.fxshard-"))


def test_a_folder_with_a_foreign_manifest_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "o"
    (out / "weights").mkdir(parents=True)
    (out / "manifest.json").write_text('{"name": "app"}')
    (out / "weights" / "final_model.bin").write_text("precious")
    before = _snapshot(out)
    with pytest.raises(OutputFolderError, match="manifest.json is not fxshard's"):
        compile_model(GPT, Layout(tp=2), out=out)
    assert _snapshot(out) == before


def test_an_out_path_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "o"
    out.write_text("a file")
    with pytest.raises(OutputFolderError, match="is a file"):
        compile_model(GPT, Layout(tp=2), out=out)
    assert out.read_text() == "a file"


def test_recompiling_keeps_the_users_files_and_replaces_only_fxshards_own(tmp_path):
    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes").mkdir()
    (out / "notes" / "run.txt").write_text("keep me")
    compile_model(GPT, Layout(tp=4), out=out)
    assert read_manifest(out).layout.tp == 4
    assert sorted(p.name for p in out.glob("rank_*.py")) == [f"rank_pp0_tp{t}.py" for t in range(4)]
    assert sorted(p.name for p in (out / "weights").iterdir()) == [f"rank_pp0_tp{t}.safetensors" for t in range(4)]
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (out / "notes" / "run.txt").read_text() == "keep me"
    assert _siblings(out) == []


def test_a_users_file_the_new_program_would_overwrite_is_refused(tmp_path):
    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    (out / "rank_pp0_tp3.py").write_text("# mine, not fxshard's")
    before = _snapshot(out)
    with pytest.raises(OutputFolderError, match="rank_pp0_tp3.py would be overwritten"):
        compile_model(GPT, Layout(tp=4), out=out)
    assert _snapshot(out) == before


def test_recompiling_from_the_folders_own_model_copy(tmp_path):
    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    compile_model(out / "model.py", Layout(tp=4), out=out)  # was SameFileError after writing tp=4 rank files
    assert read_manifest(out).layout.tp == 4
    assert (out / "model.py").read_bytes() == GPT.read_bytes()


def test_a_failed_compile_leaves_the_old_folder_untouched(tmp_path, monkeypatch):
    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    before = _snapshot(out)
    with pytest.raises(ShardingError):  # fails while transforming
        compile_model(GPT, Layout(tp=3), out=out)
    assert _snapshot(out) == before

    import fxshard.compiler

    def disk_full(tensors, path, metadata=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fxshard.compiler, "save_file", disk_full)  # fails half-way through writing
    with pytest.raises(OSError, match="No space left"):
        compile_model(GPT, Layout(tp=4), out=out)
    assert _snapshot(out) == before
    assert _siblings(out) == []


def test_a_symlinked_model_copy_is_not_written_through(tmp_path):
    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    outside = tmp_path / "elsewhere.py"
    outside.write_text("# someone else's file\n")
    (out / "model.py").unlink()
    os.symlink(outside, out / "model.py")
    compile_model(GPT, Layout(tp=2), out=out)
    assert outside.read_text() == "# someone else's file\n"
    assert not (out / "model.py").is_symlink() and (out / "model.py").read_bytes() == GPT.read_bytes()


@pytest.mark.parametrize("key, value", [("file", "../../../../etc/passwd"), ("weights", "/etc/hostname"),
                                        ("model_file", "/etc/passwd"), ("model_file", "../o.py")])
def test_a_manifest_path_outside_the_folder_is_refused_by_every_reader(tmp_path, key, value):
    from fxshard.tools.check import check_output

    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    (tmp_path / "o.py").write_text("raise SystemExit('ran a file outside the folder')\n")
    manifest = json.loads((out / "manifest.json").read_text())
    if key == "model_file":
        manifest[key] = value
    else:
        manifest["ranks"][1][key] = value
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(OutputFolderError, match=f"is {re.escape(repr(value))}, which resolves to"):
        read_manifest(out)
    with pytest.raises(OutputFolderError, match="outside"):
        check_output(out)


def test_the_show_command_refuses_a_rank_file_outside_the_folder(tmp_path):
    from fxshard.cli.app import app
    from typer.testing import CliRunner

    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["ranks"][1]["file"] = "../../../../etc/passwd"
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(app, ["show", str(out), "--rank", "1"])
    assert result.exit_code != 0
    assert "root:" not in result.output and "outside" in result.output


def test_a_checkpoint_whose_latest_climbs_out_is_refused(tmp_path):
    from fxshard.train.checkpoint import CheckpointError, find_checkpoint

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "index.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("../elsewhere")
    with pytest.raises(CheckpointError, match="outside"):
        find_checkpoint(tmp_path / "ckpt")
