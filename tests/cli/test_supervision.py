"""Workers never train unsupervised: real signals sent by pid to a real `fxshard run`.

A kill -9 of the launcher takes its workers with it; SIGTERM / SIGINT on the launcher ends the run with one line
and no worker left; a checkpoint folder in use by a run is refused to a second one, naming the holder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import cli

MLP = Path(__file__).resolve().parents[1] / "models" / "mlp.py"
GPT = Path(__file__).resolve().parents[2] / "samples" / "gpt.py"


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start(out: Path, ckpt: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "fxshard.cli.app", "run", str(out), "--steps", "100000",
                             "--checkpoint", str(ckpt), "--save-every", "1", "--no-check"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # training has begun once rank 0 has saved a step
        if "saved checkpoint" in line or time.monotonic() > deadline:
            break
    return proc


@pytest.fixture
def out(tmp_path):
    folder = tmp_path / "o"
    compile_model(MLP, Layout(tp=2), out=folder)
    return folder


@contextlib.contextmanager
def _frozen(pids):
    """Every process of ``pids`` stopped (SIGSTOP) inside the block and let go on (SIGCONT) after it, so that what
    the block reads (a checkpoint folder) cannot change under it; one killed inside the block stays dead."""
    pids = list(pids)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _gone_within(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return {p for p in pids if _alive(p)}


@pytest.mark.e2e
def test_kill_9_of_the_launcher_takes_its_workers_with_it(out, tmp_path):
    proc = _start(out, tmp_path / "ckpt")
    workers = _children(proc.pid)
    assert len(workers) >= 2, "the run's workers were not found"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    left = _gone_within(workers, 20)
    for pid in left:  # leave nothing behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {sorted(left)} kept running after the launcher was killed"


@pytest.mark.e2e
def test_kill_9_of_the_launcher_while_its_workers_start_leaves_none(out, tmp_path):
    """Killed before a worker could ask for PDEATHSIG (it is still importing torch): the worker is init's child by
    then, and must notice on its own instead of waiting --timeout for a store that died with the launcher."""
    proc = subprocess.Popen([sys.executable, "-m", "fxshard.cli.app", "run", str(out), "--steps", "100000",
                             "--checkpoint", str(tmp_path / "ckpt"), "--save-every", "1", "--no-check"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    workers: set[int] = set()
    while len(workers) < 2 and time.monotonic() < deadline:
        workers = _children(proc.pid)
        time.sleep(0.001)  # the workers import torch for seconds: a millisecond's look finds them still starting
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(workers) >= 2, "the run's workers were not found"
    left = _gone_within(workers, 60)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {sorted(left)} outlived their launcher"
    assert not list((tmp_path / "ckpt").glob("step-*"))  # none trained


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.matrix)])
def test_a_signal_to_the_launcher_stops_the_run_in_one_line(out, tmp_path, sig):
    ckpt = tmp_path / "ckpt"
    proc = _start(out, ckpt)
    workers = _children(proc.pid)
    # the second writer: a --resume run on the folder the first is saving into
    second = cli("run", out, "--steps", 100000, "--checkpoint", ckpt, "--save-every", 1, "--resume", "--no-check",
                 timeout=120)
    assert second.returncode == 2 and "another run (pid" in second.stderr and "launching" not in second.stdout
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    left = _gone_within(workers, 20)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {sorted(left)} kept running after {sig.name}"
    assert proc.returncode != 0
    # one line: no traceback, no worker's KeyboardInterrupt, none of the agent's "Sending process ..." lines
    assert err.split() == f"error: interrupted by {sig.name}: the 2 worker processes were stopped".split(), err


def _ranks(pid: int) -> dict[int, int]:
    """Rank -> pid of the launcher ``pid``'s workers (a child still between fork and exec has no RANK yet; a rank's
    DataLoader workers inherit its RANK, and are passed over as children of a process that has one)."""
    ranked = {}
    for child in _children(pid):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        rank = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK=")), None)
        if rank is not None:
            ranked[child] = (int(rank), parent)
    return {rank: child for child, (rank, parent) in ranked.items() if parent not in ranked}


@pytest.mark.e2e
def test_kill_9_of_a_worker_ends_the_run_naming_it(out, tmp_path):
    proc = _start(out, tmp_path / "ckpt")
    workers = _ranks(proc.pid)
    os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    left = _gone_within(set(workers.values()), 20)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 2 and not left
    assert f"rank 1 was killed by SIGKILL (pid {workers[1]}), not by fxshard" in err, err
    assert "rank 0 was stopped by the launcher (SIGTERM) because rank 1 failed" in err, err
    assert "Traceback" not in err and "Sending process" not in err


@pytest.mark.e2e
@pytest.mark.parametrize("victim", [0, pytest.param(1, marks=pytest.mark.matrix)])
def test_kill_9_of_a_worker_in_the_middle_of_a_save_then_resume(tmp_path, victim):
    """The workers are frozen (SIGSTOP) the moment a save's temporary folder appears; if it is still there, the
    save is under way, and one worker is killed with SIGKILL, the other let go on (SIGCONT)."""
    out, ckpt = tmp_path / "o", tmp_path / "ckpt"
    compile_model(GPT, Layout(tp=2), out=out)
    proc = subprocess.Popen([sys.executable, "-m", "fxshard.cli.app", "run", str(out), "--steps", "100000",
                             "--checkpoint", str(ckpt), "--save-every", "1", "--no-check", "--timeout", "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline, workers, caught = time.monotonic() + 240, {}, []
    try:
        while not caught and time.monotonic() < deadline and proc.poll() is None:
            if len(workers) < 2:
                workers = _ranks(proc.pid)
                time.sleep(0.01)
                continue
            saves = [p for p in ckpt.glob("step-*.tmp-*") if int(p.name[5:13]) >= 2]  # latest names a step
            if not saves:
                time.sleep(0.001)  # a millisecond's look, not a spin: the ranks need the cores
                continue
            with _frozen(workers.values()):
                caught = [p for p in ckpt.glob("step-*.tmp-*") if p.is_dir()]
                if caught:
                    os.kill(workers[victim], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        for pid in _gone_within(set(workers.values()), 20):
            os.kill(pid, signal.SIGKILL)
    assert caught, "never caught a save in progress"
    assert proc.returncode == 2 and f"rank {victim} was killed by SIGKILL" in err, err
    interrupted = int(caught[0].name[5:13])
    assert (ckpt / "latest").read_text().strip() == f"step-{interrupted - 1:08d}"  # the last complete save
    resumed = cli("run", out, "--steps", interrupted, "--checkpoint", ckpt, "--save-every", 1, "--resume", "--no-check",
                  timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"step {interrupted}/{interrupted}" in resumed.stdout  # resumed after the last complete save
    assert f"step {interrupted - 1}/" not in resumed.stdout
    assert (ckpt / "latest").read_text().strip() == f"step-{interrupted:08d}"
    assert not list(ckpt.glob("step-*.tmp-*"))  # the killed save's partial folder is gone with the next save


def _listening(pids: set[int]) -> list[str]:
    """``addr:port`` of every listening TCP socket the processes ``pids`` hold (from /proc/net/tcp{,6})."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                if width == 8:
                    addr = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                found.append(f"{addr}:{int(port, 16)}")
    return found


@pytest.mark.e2e
def test_the_local_launcher_and_its_workers_listen_on_loopback_only(out, tmp_path):
    proc = _start(out, tmp_path / "ckpt")
    try:
        listening = _listening({proc.pid} | _children(proc.pid))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    assert listening, "no listening socket found: the probe is broken"
    assert all(a.startswith("127.") for a in listening), [a for a in listening if not a.startswith("127.")]
