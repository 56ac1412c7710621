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
from fxshard.driver import compile as compile_model
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


def test_out_naming_the_model_files_own_folder_or_the_root_is_refused(tmp_path):
    model = tmp_path / "src" / "gpt.py"
    model.parent.mkdir()
    model.write_bytes(GPT.read_bytes())
    (model.parent / "data.txt").write_text("mine")
    before = _snapshot(model.parent)
    with pytest.raises(OutputFolderError, match="is not an fxshard output folder"):
        compile_model(model, Layout(tp=2), out=model.parent)
    assert _snapshot(model.parent) == before and _siblings(model.parent) == []
    with pytest.raises(OutputFolderError, match="/: exists and is not an fxshard output folder"):
        compile_model(GPT, Layout(tp=2), out=Path("/"))


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


@pytest.mark.slow
def test_recompiling_from_the_folders_own_model_copy(tmp_path):
    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    compile_model(out / "model.py", Layout(tp=4), out=out)  # was SameFileError after writing tp=4 rank files
    assert read_manifest(out).layout.tp == 4
    assert (out / "model.py").read_bytes() == GPT.read_bytes()


@pytest.mark.slow
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


def test_a_file_written_into_the_folder_during_the_compile_is_kept(tmp_path, monkeypatch):
    import fxshard.compiler

    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    real_save = fxshard.compiler.save_file

    def save_while_a_run_writes(tensors, path, metadata=None):
        (out / "metrics.jsonl").write_text('{"step": 7}\n')  # e.g. a run of the old program, started meanwhile
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(fxshard.compiler, "save_file", save_while_a_run_writes)
    compile_model(GPT, Layout(tp=4), out=out)  # the old folder, with that file in it, was deleted after the swap
    assert (out / "metrics.jsonl").read_text() == '{"step": 7}\n'


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


def test_a_read_only_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    import fxshard.files.staged as folder

    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    # root may write anywhere, so the kernel's answer for a 0555 folder is given here: moving the user's files out
    # of it would fail half-way through the swap
    monkeypatch.setattr(folder.os, "access", lambda path, mode: Path(path) != out)
    with pytest.raises(OutputFolderError, match=r"is read-only, so fxshard cannot replace the program in it"):
        compile_model(GPT, Layout(tp=4), out=out)
    assert _snapshot(out) == before and _siblings(out) == []


def test_out_dot_from_inside_the_folder_recompiles_it(tmp_path, monkeypatch):
    out = tmp_path / "o"
    compile_model(GPT, Layout(tp=2), out=out)
    (out / "notes.txt").write_text("mine")
    monkeypatch.chdir(out)
    compile_model(Path("model.py"), Layout(tp=4), out=Path("."))  # was OSError: Device or resource busy: '.'
    assert json.loads((out / "manifest.json").read_text())["layout"]["tp"] == 4
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in out.iterdir() if "fxshard-" in p.name] == [] and _siblings(out) == []


@pytest.mark.slow
def test_out_naming_a_symlink_replaces_the_folder_it_points_at(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    compile_model(GPT, Layout(tp=2), out=real)
    (real / "notes.txt").write_text("mine")
    link.symlink_to(real)
    compile_model(GPT, Layout(tp=4), out=link)  # was: link replaced by a folder, then rmtree on a symlink raised
    assert link.is_symlink() and json.loads((real / "manifest.json").read_text())["layout"]["tp"] == 4
    assert (real / "notes.txt").read_text() == "mine"
    assert _siblings(real) == [] and _siblings(link) == []


@pytest.mark.slow
def test_a_compiled_folder_keeps_ordinary_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        compile_model(GPT, Layout(tp=2), out=tmp_path / "new")
        assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755  # not a temporary folder's 0700
        (tmp_path / "new").chmod(0o750)
        compile_model(GPT, Layout(tp=4), out=tmp_path / "new")
        assert (tmp_path / "new").stat().st_mode & 0o777 == 0o750  # a recompile keeps the folder's own mode
    finally:
        os.umask(mask)


@pytest.mark.slow
@pytest.mark.parametrize("key, value", [("file", "../../../../etc/passwd"), ("weights", "/etc/hostname"),
                                        ("model_file", "/etc/passwd"), ("model_file", "../o.py")])
def test_a_manifest_path_outside_the_folder_is_refused_by_every_reader(tmp_path, key, value):
    from fxshard.check.check import check_output

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


def test_a_latest_that_is_a_link_out_of_the_folder_is_not_read(tmp_path):
    from fxshard.train.checkpoint import CheckpointError, find_checkpoint

    secret = tmp_path / "secret.txt"
    secret.write_text("step-but-secret")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").symlink_to(secret)
    with pytest.raises(CheckpointError, match="the file itself is 'latest', which resolves to .*outside") as info:
        find_checkpoint(tmp_path / "ckpt")
    assert "step-but-secret" not in str(info.value)  # its content was shown in the fallback message before


def test_the_fallback_never_picks_a_step_that_links_out_of_the_folder(tmp_path):
    from fxshard.train.checkpoint import find_checkpoint

    ckpt = tmp_path / "ckpt"
    for step in ("step-00000001", "step-00000002.tmp-1234abcd"):
        (ckpt / step).mkdir(parents=True)
        (ckpt / step / "index.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "index.json").write_text("{}")
    (ckpt / "step-00000099").symlink_to(tmp_path / "elsewhere")
    (ckpt / "latest").write_text("step-00000005\n")  # names a step that does not exist
    said = []
    assert find_checkpoint(ckpt, said.append) == ckpt / "step-00000001"
    assert said == [f"{ckpt / 'latest'} names step-00000005, which does not exist; using step-00000001, the newest "
                    "complete checkpoint"]
