"""fxshard.files, the one writer (issue 45 items 1-5 at their root): only fxshard's own files are replaced, a set of
files switches together or not at all, a linked folder fxshard names is refused, and what a ``kill -9`` leaves (a
temporary, a set switched half-way) is cleaned up or finished by the next write.  The kills are real: a writer
process is sent SIGKILL (by pid) in the middle of its write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxshard.files import (
    RECORD,
    FileSet,
    ForeignFileError,
    UnsafePathError,
    make_folder,
    open_log,
    write_text,
)

ROOT = Path(__file__).resolve().parents[2]


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name != RECORD)


def test_a_file_fxshard_did_not_write_is_never_replaced(tmp_path):
    mine = tmp_path / "profile.json"
    mine.write_text("the user's\n")
    with pytest.raises(ForeignFileError, match=r"profile.json: exists, and fxshard did not write it .*Move it away"):
        write_text(mine, "{}", "a hardware profile")
    assert mine.read_text() == "the user's\n"
    ours = tmp_path / "ours.json"
    write_text(ours, "1", "a hardware profile")
    write_text(ours, "2", "a hardware profile")  # fxshard's own, unchanged since: replaced
    assert ours.read_text() == "2"
    with pytest.raises(ForeignFileError, match=r"fxshard wrote it as a hardware profile, not as the report"):
        write_text(ours, "<html>", "the report")
    time.sleep(0.01)
    ours.write_text("edited by hand")  # fxshard's file, changed since: the user's now
    with pytest.raises(ForeignFileError, match=r"ours.json: changed since fxshard wrote it"):
        write_text(ours, "3", "a hardware profile")
    assert ours.read_text() == "edited by hand" and _hidden(tmp_path) == []


def test_a_link_where_a_file_or_a_folder_goes_is_refused_and_its_target_kept(tmp_path):
    target = tmp_path / "target.json"
    target.write_text("kept")
    os.symlink(target, tmp_path / "link.json")
    with pytest.raises(UnsafePathError, match=r"link.json: is a symbolic link \(to .*target.json\)"):
        write_text(tmp_path / "link.json", "x", "a hardware profile")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "tokenizer")
    with pytest.raises(UnsafePathError, match=r"tokenizer: is a symbolic link .* where fxshard writes the tokenizer"):
        make_folder(tmp_path / "tokenizer", "the tokenizer folder")
    assert target.read_text() == "kept" and list(elsewhere.iterdir()) == []


def _token_set(folder: Path) -> dict[Path, str]:
    return {folder / "t.bin": "a token file's ids", folder / "t.idx": "a token file's index",
            folder / "t.json": "a token file's sidecar"}


def test_a_set_switches_together_and_a_failed_write_leaves_the_old_set_whole(tmp_path):
    members = _token_set(tmp_path)
    with FileSet(members) as staged:
        for path in members:
            staged.write(path, f"old {path.suffix}")
    with pytest.raises(RuntimeError, match="the corpus failed"), FileSet(members) as staged:
        staged.write(tmp_path / "t.idx", "new .idx")  # written first, as tokenize's old order did
        raise RuntimeError("the corpus failed")
    assert {p.name: p.read_text() for p in members} == {"t.bin": "old .bin", "t.idx": "old .idx", "t.json": "old .json"}
    assert _hidden(tmp_path) == []
    with FileSet(members) as staged:  # a member not written (an optional sidecar) goes with the old set
        staged.write(tmp_path / "t.bin", "new .bin")
        staged.write(tmp_path / "t.json", "new .json")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["t.bin", "t.json"]


def test_a_set_is_refused_whole_before_any_work_when_one_member_is_not_fxshards(tmp_path):
    (tmp_path / "t.json").write_text('{"a": "tokenizer config of the user"}')
    (tmp_path / "t.idx").mkdir()
    with pytest.raises(UnsafePathError, match=r"t.idx: is a folder where fxshard writes a token file's index"):
        FileSet(_token_set(tmp_path)).__enter__()
    os.rmdir(tmp_path / "t.idx")
    with pytest.raises(ForeignFileError, match=r"t.json: exists, and fxshard did not write it"):
        FileSet(_token_set(tmp_path)).__enter__()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


WRITER = """
import sys, time
from pathlib import Path
from fxshard.files import open_writing
with open_writing(Path(sys.argv[1]), "a token dump") as f:
    f.write(b"partial")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
"""


def test_a_temporary_left_by_kill_9_is_removed_by_the_next_write(tmp_path):
    out = tmp_path / "ids.bin"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert writer.stdout.readline().strip() == "writing"
        left = _hidden(tmp_path)
        assert len(left) == 1 and left[0].startswith(".ids.bin.fxshard-"), left
        write_text(tmp_path / "other.txt", "x", "a note")  # a live writer's temporary is never touched
        assert _hidden(tmp_path) == left
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert _hidden(tmp_path) == left and not out.exists()
    write_text(tmp_path / "other.txt", "y", "a note")  # the next write into the folder cleans up after the dead one
    assert _hidden(tmp_path) == []


SWITCHER = """
import sys
from pathlib import Path
from fxshard.files import FileSet
folder = Path(sys.argv[1])
members = {folder / "t.bin": "a token file's ids", folder / "t.idx": "a token file's index",
           folder / "t.json": "a token file's sidecar"}
with FileSet(members) as staged:
    for path in members:
        staged.write(path, "new " + path.suffix)
"""


def test_a_set_switch_killed_half_way_is_finished_by_the_next_write(tmp_path):
    members = _token_set(tmp_path)
    with FileSet(members) as staged:
        for path in members:
            staged.write(path, f"old {path.suffix}")
    env = os.environ | {"FXSHARD_TEST_KILL_IN_SWITCH": "1"}  # SIGKILL after the first of the three renames
    killed = subprocess.run([sys.executable, "-c", SWITCHER, str(tmp_path)], env=env, cwd=ROOT, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert [p.read_text() for p in members] == ["new .bin", "old .idx", "old .json"]  # half switched
    assert json.loads((tmp_path / RECORD).read_text())["switching"]
    with pytest.warns(UserWarning, match=r"finished putting t.idx, t.json in place"):
        write_text(tmp_path / "note.txt", "x", "a note")  # any write into the folder finishes it first
    assert [p.read_text() for p in members] == ["new .bin", "new .idx", "new .json"]
    assert _hidden(tmp_path) == [] and "switching" not in json.loads((tmp_path / RECORD).read_text())


def test_a_log_is_fxshards_by_its_inode_and_a_users_file_is_never_emptied(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes\n")
    with pytest.raises(ForeignFileError, match="notes.txt: exists, and fxshard did not write it"):
        open_log(notes, "the run's metrics", append=False)
    assert notes.read_text() == "the user's notes\n"
    with open_log(tmp_path / "m.jsonl", "the run's metrics", append=False) as f:
        f.write('{"step": 1}\n')
    with open_log(tmp_path / "m.jsonl", "the run's metrics", append=True) as f:  # it grew: still fxshard's
        f.write('{"step": 2}\n')
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
