"""Forked rank workers (``FXSHARD_WORKERS=fork``, :mod:`fxshard.train.zygote`) are what exec'd ones are to their
launcher: its children with their own pids and sessions, their own environment and command line in /proc, the exit
status ``python -m`` gives (a ``sys.exit`` code, an escaping exception's 1 and traceback, ``os._exit``'s code, a
signal's), in real processes; and ``fxshard run`` trains the same losses with its workers forked or exec'd.
The supervision tests (tests/cli/test_supervision.py, test_timeouts.py, test_run_faults.py, ...) run under the
harness's default, forked workers; ``FXSHARD_START_METHOD=spawn`` runs them exec'd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxshard.errors import FxshardError
from fxshard.testing import cli
from fxshard.train.local import launch_local
from fxshard.train.zygote import WORKERS

MLP = Path(__file__).resolve().parents[1] / "models" / "mlp.py"

PROBE = '''
import json, os, sys, signal
mode = sys.argv[1]
environ = dict(e.split("=", 1) for e in open("/proc/self/environ").read().split("\\0") if "=" in e)
stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
print(json.dumps({"mode": mode, "pid": os.getpid(), "ppid": os.getppid(), "sid": int(stat[3]), "name": __name__,
                  "rank": os.environ.get("RANK"), "proc_rank": environ.get("RANK"), "argv": sys.argv,
                  "cmdline": open("/proc/self/cmdline").read().split("\\0")[:-1]}), flush=True)
if mode == "exit3":
    sys.exit(3)
if mode == "os_exit":
    os._exit(5)
if mode == "raise":
    raise RuntimeError("boom in the rank")
if mode == "wait":
    signal.pause()
'''

LAUNCHER = '''
import json, os, signal, subprocess, sys, time
from pathlib import Path
tmp = Path(sys.argv[1])
sys.path.insert(0, str(tmp))
from fxshard.train.zygote import Zygotes
zygotes = Zygotes.start(4)
assert zygotes.popen(("/bin/true",), {}, None, None) is None  # not ``python -m``: Popen's business
procs = {}
for rank, mode in enumerate(["exit3", "os_exit", "raise", "wait"]):
    out = open(tmp / f"{mode}.out", "w")
    procs[mode] = zygotes.popen((sys.executable, "-m", "probe", mode), dict(os.environ, RANK=str(rank)), out, out)
    out.close()
while not (tmp / "wait.out").read_text():
    time.sleep(0.01)
try:
    procs["wait"].wait(0.05)
    timed_out = False
except subprocess.TimeoutExpired:
    timed_out = True
procs["wait"].send_signal(signal.SIGKILL)
codes = {mode: proc.wait(60) for mode, proc in procs.items()}
idle = Zygotes.start(2)
idle.close()  # ends and reaps the children no worker was made of
children = []
for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
        if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
            children.append(int(stat.parent.name))
    except (OSError, ValueError):
        pass
print(json.dumps({"launcher": os.getpid(), "codes": codes, "timed_out": timed_out,
                  "pids": {m: p.pid for m, p in procs.items()}, "children": children}))
'''


def test_forked_workers_answer_as_popen_and_look_exec_d(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["codes"] == {"exit3": 3, "os_exit": 5, "raise": 1, "wait": -9}, report
    assert report["timed_out"], "wait(timeout) returned while the worker ran"
    assert "Traceback" in (tmp_path / "raise.out").read_text() and "RuntimeError: boom in the rank" in (
        tmp_path / "raise.out").read_text()
    for rank, mode in enumerate(["exit3", "os_exit", "raise", "wait"]):
        probe = json.loads((tmp_path / f"{mode}.out").read_text().splitlines()[0])
        assert probe["pid"] == report["pids"][mode] and probe["ppid"] == report["launcher"], probe
        assert probe["sid"] == probe["pid"], "a forked worker leads its own session, as start_new_session gives"
        assert probe["rank"] == probe["proc_rank"] == str(rank), probe  # /proc/PID/environ shows the rank's
        assert probe["cmdline"] == [sys.executable, "-m", "probe", mode], probe
        assert probe["name"] == "__main__" and probe["argv"] == [str(tmp_path / "probe.py"), mode], probe
    assert report["children"] == [], f"children left unreaped: {report['children']}"


@pytest.mark.e2e
def test_run_trains_the_same_with_workers_forked_or_execd(tmp_path):
    out = tmp_path / "o"
    assert cli("compile", MLP, "--tp", 2, "--out", out).returncode == 0
    losses = {}
    for method in ("exec", "fork"):
        metrics = tmp_path / f"{method}.jsonl"
        run = cli("run", out, "--steps", 3, "--metrics", metrics, env=os.environ | {"FXSHARD_WORKERS": method})
        assert run.returncode == 0, run.stdout + run.stderr
        losses[method] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses["exec"]) == 3 and losses["fork"] == losses["exec"], losses


def test_an_unknown_worker_start_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(WORKERS, "vfork")
    with pytest.raises(FxshardError, match="FXSHARD_WORKERS='vfork': expected 'exec' .* or 'fork'"):
        launch_local(tmp_path, ["run", str(tmp_path)], 2)  # refused before anything starts
