"""A swap's journal is locked by its writer, and only the writer: a ``kill -9`` must leave it free for the next
compile.  make test once saw a compile killed mid-swap leave its journal locked, the next compile saying "another
fxshard (pid N) is writing" of a dead N (tests/cli/test_swap.py's kill -9 test): the swap looked up the C library
with ``ctypes.util.find_library``, which forks ``ldconfig -p``, and the child held a copy of the locked descriptor
until its exec.  The swap now starts no process; a lock a dead writer's child still holds is waited for, briefly,
then refused by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxshard.codegen.folder import PROGRAM
from fxshard.codegen.manifest import read_manifest
from fxshard.driver import compile as compile_model
from fxshard.errors import FxshardWarning, OutputFolderError
from fxshard.files import staged
from fxshard.files.staged import JOURNAL, recover_interrupted
from fxshard.ir.context import Layout

MLP = Path(__file__).resolve().parents[1] / "models" / "mlp.py"
STARTS = ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system")
_started: list[list[str]] = []  # the open recordings (an audit hook cannot be removed: it records only into these)


def _audit(event: str, args) -> None:
    if event in STARTS:
        for record in _started:
            record.append(f"{event} {args[0]!r}")


sys.addaudithook(_audit)


def test_recompiling_a_folder_starts_no_process_while_the_journal_is_locked(tmp_path):
    out = tmp_path / "o"
    compile_model(MLP, Layout(tp=2), out=out)
    started: list[str] = []
    _started.append(started)
    try:  # the recompile swaps: renameat2 looked up, its journal locked from the stage's start to the swap's end
        compile_model(MLP, Layout(tp=4), out=out)
    finally:
        _started.remove(started)
    assert started == [], f"the compile started a process: {started}"
    assert read_manifest(out).layout.tp == 4 and not (out / JOURNAL).exists()


# a writer that dies (os._exit, as a kill -9 leaves it) while a child it forked holds its journal's descriptor
_DEAD_WRITER = """
import os, sys, time
from pathlib import Path
from fxshard.files.staged import _Stage
stage = _Stage(Path(sys.argv[1]))
child = os.fork()
if child == 0:  # the child: holds a copy of the locked descriptor for a while (not the output pipe), then exits
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(float(sys.argv[2]))
    os._exit(0)
print(stage.path.name, child, flush=True)
os._exit(0)
"""


def _dead_writer(out: Path, child_s: float) -> tuple[str, int]:
    """The stage's name and the child's pid."""
    done = subprocess.run([sys.executable, "-c", _DEAD_WRITER, str(out), str(child_s)], capture_output=True,
                          text=True, timeout=120, check=True)
    stage, child = done.stdout.split()
    return stage, int(child)


def test_a_dead_writers_journal_held_by_its_child_a_moment_is_recovered(tmp_path):
    out = tmp_path / "o"
    stage, _ = _dead_writer(out, child_s=1.0)
    assert (tmp_path / stage / JOURNAL).exists()
    start = time.monotonic()
    with pytest.warns(FxshardWarning, match=rf"removed {stage}: the staging folder of a compile killed before"):
        recover_interrupted(out, PROGRAM)
    assert time.monotonic() - start < staged.INHERITED_WAIT_S and not (tmp_path / stage).exists()


def test_a_dead_writers_journal_a_child_keeps_is_refused_naming_the_journal(tmp_path, monkeypatch):
    monkeypatch.setattr(staged, "INHERITED_WAIT_S", 0.5)
    out = tmp_path / "o"
    stage, child = _dead_writer(out, child_s=60.0)
    try:
        with pytest.raises(OutputFolderError, match=rf"the fxshard \(pid \d+\) that was writing this program has "
                                                    rf"ended, but a process it started still holds its journal "
                                                    rf"\S+{stage}/"):
            recover_interrupted(out, PROGRAM)
        assert (tmp_path / stage / JOURNAL).exists()  # nothing touched
    finally:
        os.kill(child, signal.SIGKILL)


def test_two_compiles_recovering_at_once_recover_once(tmp_path):
    """The lock is held through a recovery: the second compile finds the journal gone once it gets the lock."""
    import threading
    import warnings

    out = tmp_path / "o"
    stage, _ = _dead_writer(out, child_s=1.0)  # both recoveries wait for the child, then race for the lock
    said: list = []
    failed: list = []

    def recover():
        try:
            said.append(recover_interrupted(out, PROGRAM))
        except BaseException as e:  # noqa: BLE001 - the test reports it
            failed.append(e)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FxshardWarning)
        threads = [threading.Thread(target=recover) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert failed == []
    assert sorted(len(m) for m in said) == [0, 1] and any(f"removed {stage}" in m[0] for m in said if m), said
    assert not (tmp_path / stage).exists()


_OTHER_HOST = """
import json, os, sys, time
from pathlib import Path
from fxshard.files.staged import _Stage
stage = _Stage(Path(sys.argv[1]))
note = json.dumps({"out": "o", "state": "writing", "pid": 999999999, "host": "another-host"}).encode()
os.ftruncate(stage.fd, 0)
os.pwrite(stage.fd, note, 0)
print(stage.path.name, flush=True)
time.sleep(60)
"""


def test_a_writer_on_another_host_is_named_so_and_not_waited_for(tmp_path):
    """A journal on a shared volume whose writer ran elsewhere: its pid is not this machine's to look up."""
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-c", _OTHER_HOST, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        stage = proc.stdout.readline().strip()
        start = time.monotonic()
        with pytest.raises(OutputFolderError, match=r"another fxshard \(pid 999999999 on another-host\) is writing"):
            recover_interrupted(out, PROGRAM)
        assert time.monotonic() - start < 1.0 and (tmp_path / stage / JOURNAL).exists()
    finally:
        proc.kill()
        proc.wait()
