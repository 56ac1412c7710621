"""The new commands keep the old promises (issue 45 items 1-5, 11, 13): ``calibrate``, ``data tokenize`` and
``data generate`` never write through a link, never replace a file fxshard did not write, switch a token file's
three files together, leave no temporary behind after a ``kill -9``, and refuse what they cannot do in one line
naming the file.  Each builds the real thing: a planted link, the user's own files, a folder where a file goes, a
process killed by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_in_process import fxshard

from fxshard.train.data.synthetic import train_tokenizer, write_corpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    write_corpus(root / "corpus", 200, sentences=(1, 3))
    train_tokenizer(root / "corpus", root / "tokenizer", vocab=256)
    return root


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _error(done) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr and "error:" in done.stderr, done.stderr
    return " ".join(done.stderr.split())


def test_calibrate_refuses_a_link_or_a_foreign_file_at_out_before_measuring(tmp_path):
    target = tmp_path / "precious.json"
    target.write_text("mine")
    os.symlink(target, tmp_path / "link.json")
    said = _error(fxshard("calibrate", "--out", tmp_path / "link.json", "--procs", 2, "--quick"))
    assert "link.json: is a symbolic link" in said and "a hardware profile" in said
    said = _error(fxshard("calibrate", "--out", target, "--procs", 2, "--quick"))
    assert "precious.json: exists, and fxshard did not write it" in said
    assert target.read_text() == "mine" and os.path.islink(tmp_path / "link.json")


def test_calibrate_refuses_more_processes_than_the_machine_holds_before_starting_one(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    def started(*args, **kwargs):  # a calibrate without the bound must fail here, never start 100,000 processes
        raise AssertionError("calibrate started its processes")

    monkeypatch.setattr(mp, "start_processes", started)
    said = _error(fxshard("calibrate", "--out", tmp_path / "p.json", "--procs", 100_000))
    assert "--procs 100000: this machine holds at most" in said and "use --procs" in said
    assert not (tmp_path / "p.json").exists()


def test_tokenize_never_replaces_a_token_file_fxshard_did_not_write(generated, tmp_path):
    for suffix in (".bin", ".idx", ".json"):
        (tmp_path / f"x{suffix}").write_text(f"the user's {suffix}")
    before = _files(tmp_path)
    said = _error(fxshard("data", "tokenize", generated / "corpus", "--tokenizer", generated / "tokenizer", "--out",
                          tmp_path / "x.bin"))
    assert "x.bin: exists, and fxshard did not write it" in said
    assert _files(tmp_path) == before


def test_tokenize_into_the_tokenizer_folder_never_replaces_its_tokenizer_json(generated, tmp_path):
    tok = tmp_path / "tok"
    train_tokenizer(generated / "corpus", tok, vocab=256)
    before = _files(tok)
    said = _error(fxshard("data", "tokenize", generated / "corpus", "--tokenizer", tok, "--out", tok / "tokenizer.bin"))
    assert "tokenizer.json: fxshard wrote it as a tokenizer, not as a token file's sidecar" in said
    assert _files(tok) == before
    again = fxshard("data", "tokenize", generated / "corpus", "--tokenizer", tok, "--out", tmp_path / "t.bin")
    assert again.returncode == 0, again.stderr  # the tokenizer still reads


def test_tokenize_to_a_folder_named_bin_is_refused_and_leaves_nothing(generated, tmp_path):
    (tmp_path / "x.bin").mkdir()
    said = _error(fxshard("data", "tokenize", generated / "corpus", "--tokenizer", generated / "tokenizer", "--out",
                          tmp_path / "x.bin"))
    assert "x.bin: is a folder where fxshard writes a token file's ids" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]


def test_a_retokenize_replaces_its_own_set(generated, tmp_path):
    args = ("data", "tokenize", generated / "corpus", "--tokenizer", generated / "tokenizer", "--out",
            tmp_path / "t.bin")
    assert fxshard(*args).returncode == 0
    again = fxshard(*args, "--validation", 0.5)
    assert again.returncode == 0, again.stderr
    assert "the last 100 the validation split" in " ".join(again.stdout.split())


def test_generate_never_overwrites_the_users_files_nor_writes_through_a_linked_folder(tmp_path):
    out = tmp_path / "gen"
    (out / "corpus").mkdir(parents=True)
    (out / "corpus" / "part-000.jsonl").write_text('{"text": "the user\'s corpus"}\n')
    said = _error(fxshard("data", "generate", out, "--documents", 50))
    assert "part-000.jsonl: exists, and fxshard did not write it" in said
    assert (out / "corpus" / "part-000.jsonl").read_text() == '{"text": "the user\'s corpus"}\n'
    (out / "corpus" / "part-000.jsonl").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "tokenizer").symlink_to(elsewhere)
    said = _error(fxshard("data", "generate", out, "--documents", 50))
    assert "tokenizer: is a symbolic link" in said and "never writes through a link" in said
    assert list(elsewhere.iterdir()) == []
    (out / "tokenizer").unlink()
    assert fxshard("data", "generate", out, "--documents", 50, "--files", 3).returncode == 0
    assert fxshard("data", "generate", out, "--documents", 50, "--files", 1).returncode == 0  # its own: replaced
    assert sorted(p.name for p in (out / "corpus").glob("part-*")) == ["part-000.jsonl"]  # no part of the larger one


def test_generate_into_a_file_is_one_line(tmp_path):
    (tmp_path / "gen").write_text("a file")
    assert "gen: is a file; data generate writes a folder" in _error(fxshard("data", "generate", tmp_path / "gen"))


@pytest.mark.e2e
def test_a_tokenize_killed_with_kill_9_leaves_nothing_the_next_one_does_not_remove(tmp_path):
    write_corpus(tmp_path / "corpus", 5_000)  # a second or more of tokenizing: long enough to be killed in it
    train_tokenizer(tmp_path / "corpus", tmp_path / "tok", vocab=256)
    data = tmp_path / "data"
    data.mkdir()
    args = [sys.executable, "-m", "fxshard.cli.app", "data", "tokenize", str(tmp_path / "corpus"), "--tokenizer",
            str(tmp_path / "tok"), "--out", str(data / "t.bin")]
    run = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not [p for p in data.iterdir() if p.name.startswith(".t.bin")]:  # its temporary is being written
        assert run.poll() is None and time.monotonic() < deadline, "tokenize ended before it could be killed"
        time.sleep(0.01)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    left = sorted(p.name for p in data.iterdir())
    assert left and all(n.startswith(".") for n in left), left  # nothing in place: only what it was writing
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in data.iterdir()) == [".fxshard-files.json", "t.bin", "t.idx", "t.json"]
