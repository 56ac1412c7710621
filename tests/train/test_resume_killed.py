"""A run killed by a signal resumes where its data was, through the command line: `fxshard run` at dp2 trains
tests/models/packed_llama.py on packed sequences of a token file written by `fxshard data tokenize` (``--data t.bin
--pack``, one loader worker per rank running ahead), saving every step, with a warmup-and-cosine schedule.  The
moment ``latest`` names step 7 the workers are frozen (SIGSTOP) and rank 1 is killed by pid (SIGKILL), so the run
dies during step 8 (or its save) with step 7 its last complete checkpoint.  Resumed to step 12 it gives:

- at dp2, the losses of an uninterrupted 12-step run, bit for bit (the token-file cursor is where training was,
  not where the worker had read ahead to);
- at dp1 (the checkpoint's data position resharded over another dp), the same losses within 1e-6 relative.

Four launches of the command line (2, 2, 2 and 1 ranks)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from test_checkpoint_cli import fxshard  # noqa: E402
from test_supervision import _frozen, _gone_within, _ranks  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

MODEL = Path(__file__).resolve().parents[1] / "models" / "packed_llama.py"
STEPS, KILLED_AFTER = 12, 7
TRAIN = ["--steps", STEPS, "--lr", "3e-3", "--weight-decay", "0.1", "--lr-schedule", "cosine", "--warmup-steps", 2,
         "--pack", "--data-workers", 1, "--no-check", "--timeout", 120]


def _losses(metrics: Path) -> dict[int, float]:
    return {x["step"]: x["loss"] for x in map(json.loads, metrics.read_text().splitlines())}


def _kill_after_save(out: Path, ckpt: Path, args: list) -> tuple[int, str]:
    """Start ``fxshard run`` saving every step; once ``latest`` names step KILLED_AFTER, freeze the workers and
    kill rank 1 by pid: (the last complete step, what the launcher printed)."""
    latest = ckpt / "latest"
    proc = subprocess.Popen([sys.executable, "-m", "fxshard.cli.app", "run", str(out), *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: dict[int, int] = {}
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if len(workers) < 2:  # the ranks' pids, found once (reading /proc takes a while)
                workers = _ranks(proc.pid)
            with contextlib.suppress(OSError):
                if latest.read_text().strip() >= f"step-{KILLED_AFTER:08d}":
                    break
            time.sleep(0.002)
        assert proc.poll() is None and len(workers) == 2, "the run ended (or never started) before step 7 was saved"
        with _frozen(workers.values()):
            saved = int(latest.read_text().strip()[5:])  # the workers are frozen: this is the last complete save
            os.kill(workers[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        for pid in _gone_within(set(workers.values()), 20):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 2 and f"rank 1 was killed by SIGKILL (pid {workers[1]})" in err, err
    return saved, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    root, _ = corpus
    tmp = tmp_path_factory.mktemp("killed")
    dp2, dp1 = tmp / "dp2", tmp / "dp1"
    compile_model(MODEL, Layout(dp=2), out=dp2)
    compile_model(MODEL, Layout(), out=dp1)
    data = ["--data", root / "t.bin"]
    fxshard("run", dp2, *TRAIN, *data, "--metrics", tmp / "uninterrupted.jsonl")
    ckpt = tmp / "ckpt"
    saved, _ = _kill_after_save(dp2, ckpt, [*TRAIN, *data, "--checkpoint", ckpt, "--save-every", 1,
                                            "--metrics", tmp / "killed.jsonl"])
    moved = tmp / "ckpt-dp1"  # the same checkpoint, resumed at another dp
    moved.mkdir()
    shutil.copytree(ckpt / f"step-{saved:08d}", moved / f"step-{saved:08d}")
    shutil.copy(ckpt / "latest", moved / "latest")
    resumed = fxshard("run", dp2, *TRAIN, *data, "--checkpoint", ckpt, "--save-every", 1, "--resume",
                      "--metrics", tmp / "resumed.jsonl")
    resharded = fxshard("run", dp1, *TRAIN, *data, "--checkpoint", moved, "--resume",
                        "--metrics", tmp / "resharded.jsonl")
    return {"saved": saved, "printed": resumed.stdout + resharded.stdout,
            **{name: _losses(tmp / f"{name}.jsonl") for name in ("uninterrupted", "killed", "resumed", "resharded")}}


def test_killed_run_resumed_in_the_same_layout_gives_the_uninterrupted_losses_bit_for_bit(runs):
    saved, full = runs["saved"], runs["uninterrupted"]
    assert KILLED_AFTER <= saved < STEPS and sorted(full) == list(range(1, STEPS + 1))
    assert all(runs["killed"][s] == full[s] for s in range(1, saved + 1))
    assert sorted(runs["resumed"]) == list(range(saved + 1, STEPS + 1))  # continued after the last complete save
    assert runs["resumed"] == {s: full[s] for s in range(saved + 1, STEPS + 1)}  # bit for bit
    print(f"killed after step {saved}'s save; resumed at dp2: steps {saved + 1}-{STEPS} bit for bit")


def test_killed_run_resumed_at_another_dp_gives_the_uninterrupted_losses(runs):
    saved, full, got = runs["saved"], runs["uninterrupted"], runs["resharded"]
    assert sorted(got) == list(range(saved + 1, STEPS + 1))
    worst = max(abs(got[s] - full[s]) / abs(full[s]) for s in got)
    assert worst <= 1e-6, f"resumed at dp1: {worst:.2e} from the uninterrupted dp2 run"
    print(f"killed after step {saved}'s save; resumed at dp1: worst {worst:.1e} relative over steps "
          f"{saved + 1}-{STEPS}")
