"""Checkpoints are never overwritten, poisoned or silently mixed (issue 32 items 3, 4, 11, 12, 16), and the run's own
files are never written through a link planted during the run.  Each test does the real thing: a second run into
the same folder, a model file edited with the same shapes, a gradient made NaN by the data, a checkpoint folder made
unwritable (``chattr +i`` as root) while the run saves, a symbolic link planted after the launcher's checks.

Every run is ``fxshard run`` in its own process (2 ranks of tests/models/mlp.py at tp=2, or 2 of
tests/models/nonfinite.py at dp=2 ZeRO 1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import cli

pytestmark = pytest.mark.e2e
MODELS = Path(__file__).resolve().parents[1] / "models"
MLP, NONFINITE, PLANTING = MODELS / "mlp.py", MODELS / "nonfinite.py", MODELS / "planting.py"


def _fxshard(*args, env=None, timeout=300):
    return cli(*args, timeout=timeout, env=None if env is None else os.environ | env)


def _steps(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))


def _latest(ckpt: Path) -> str:
    return (ckpt / "latest").read_text().strip()


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp") / "o"
    compile_model(MLP, Layout(tp=2), out=out)
    return out


def test_a_new_run_into_an_earlier_runs_checkpoints_is_refused_unless_overwrite(mlp, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _fxshard("run", mlp, "--steps", 2, "--checkpoint", ckpt, "--save-every", 1)
    assert first.returncode == 0, first.stdout + first.stderr
    again = _fxshard("run", mlp, "--steps", 1, "--checkpoint", ckpt, "--save-every", 1)
    assert again.returncode == 2 and "launching" not in again.stdout, again.stdout + again.stderr
    for fix in ("--resume", "another --checkpoint folder", "--overwrite"):
        assert fix in again.stderr, again.stderr
    assert _latest(ckpt) == "step-00000002" and _steps(ckpt) == ["step-00000001", "step-00000002"]
    both = _fxshard("run", mlp, "--steps", 3, "--checkpoint", ckpt, "--resume", "--overwrite")
    assert both.returncode == 2 and "pass one" in both.stderr
    over = _fxshard("run", mlp, "--steps", 1, "--checkpoint", ckpt, "--save-every", 1, "--overwrite")
    assert over.returncode == 0, over.stdout + over.stderr
    assert _steps(ckpt) == ["step-00000001"] and _latest(ckpt) == "step-00000001"  # the earlier run's step 2 gone


def test_keep_last_keeps_the_newest_complete_steps(mlp, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = _fxshard("run", mlp, "--steps", 5, "--checkpoint", ckpt, "--save-every", 1, "--keep-last", 2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert _steps(ckpt) == ["step-00000004", "step-00000005"] and _latest(ckpt) == "step-00000005"
    # resumed from the newest: its own steps pruned the same way, latest's step never deleted
    more = _fxshard("run", mlp, "--steps", 7, "--checkpoint", ckpt, "--save-every", 1, "--keep-last", 1, "--resume")
    assert more.returncode == 0, more.stdout + more.stderr
    assert _steps(ckpt) == ["step-00000007"] and _latest(ckpt) == "step-00000007"
    bad = _fxshard("run", mlp, "--steps", 2, "--checkpoint", tmp_path / "c2", "--keep-last", -1)
    assert bad.returncode == 2 and "--keep-last -1" in bad.stderr


def test_resuming_another_model_or_schedule_is_refused_before_launch(mlp, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _fxshard("run", mlp, "--steps", 2, "--checkpoint", ckpt, "--save-every", 2)
    assert first.returncode == 0, first.stdout + first.stderr
    gelu = tmp_path / "mlp_gelu.py"  # the same parameters, another activation
    gelu.write_text(MLP.read_text().replace("torch.relu(", "torch.nn.functional.gelu("))
    changed = tmp_path / "gelu"
    compile_model(gelu, Layout(tp=2), out=changed)
    refused = _fxshard("run", changed, "--steps", 4, "--checkpoint", ckpt, "--resume")
    assert refused.returncode == 2 and "launching" not in refused.stdout, refused.stdout + refused.stderr
    assert "mlp.py" in refused.stderr and "mlp_gelu.py" in refused.stderr and "--allow-changed-model" in \
        refused.stderr, refused.stderr
    for option, says in ((["--steps", 2], "--steps 2 leaves nothing to run"), (["--steps", 4, "--lr", 0.5],
                                                                                 "--lr 0.5 (saved: 0.001)")):
        early = _fxshard("run", mlp, *option, "--checkpoint", ckpt, "--resume")
        assert early.returncode == 2 and says in early.stderr and "launching" not in early.stdout, early.stderr
    allowed = _fxshard("run", changed, "--steps", 3, "--checkpoint", ckpt, "--resume", "--allow-changed-model")
    assert allowed.returncode == 0 and "step 3/3" in allowed.stdout, allowed.stdout + allowed.stderr
    assert "Traceback" not in refused.stderr + early.stderr


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite") / "o"
    compile_model(NONFINITE, Layout(dp=2, zero=1), out=out)
    return out


def test_a_nan_gradient_with_a_finite_loss_stops_the_run_before_the_update(nonfinite, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run = _fxshard("run", nonfinite, "--steps", 4, "--checkpoint", ckpt, "--save-every", 1, "--metrics", metrics)
    said = run.stdout + run.stderr
    assert run.returncode != 0 and "step 3: the gradient norm is nan (the loss" in said, said
    assert "is finite)" in said and "Traceback" not in said
    assert _steps(ckpt) == ["step-00000001", "step-00000002"] and _latest(ckpt) == "step-00000002"
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]


def test_a_skipped_step_leaves_the_parameters_as_a_run_without_its_batch(nonfinite, tmp_path):
    skipped, without = tmp_path / "skipped", tmp_path / "without"
    run = _fxshard("run", nonfinite, "--steps", 4, "--on-nonfinite", "skip", "--final-state", skipped,
                   "--checkpoint", tmp_path / "ckpt", "--save-every", 1, "--metrics", tmp_path / "m.jsonl")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "step 3: skipped, the gradient norm is nan" in run.stdout, run.stdout
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x.get("skipped", False) for x in lines] == [False, False, True, False]
    clean = _fxshard("run", nonfinite, "--steps", 3, "--final-state", without, env={"FXSHARD_TEST_POISON": "0"})
    assert clean.returncode == 0, clean.stdout + clean.stderr
    for rank in (0, 1):  # steps 1, 2, (3 skipped), 4 == steps 1, 2, 3 without the poisoned batch: bit for bit
        got, want = (load_file(str(d / f"rank{rank}.safetensors")) for d in (skipped, without))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), rank
        assert all(torch.isfinite(t).all() for t in got.values())
    bad = _fxshard("run", nonfinite, "--steps", 1, "--on-nonfinite", "ignore")
    assert bad.returncode == 2 and "--on-nonfinite ignore: expected one of stop, skip" in bad.stderr


def _unwritable(folder: Path):
    """Make ``folder`` refuse new entries, as root too (``chattr +i``); the undo."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        pytest.skip("running as root where chattr +i is not available: nothing makes a folder unwritable")
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_checkpoint_folder_made_unwritable_mid_run_is_named_with_its_rank(mlp, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = subprocess.Popen([sys.executable, "-m", "fxshard.cli.app", "run", str(mlp), "--steps", "2000",
                            "--checkpoint", str(ckpt), "--save-every", "1", "--no-check"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    undo = None
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "step-00000002").is_dir():
            assert run.poll() is None and time.monotonic() < deadline, "the run never saved step 2"
            time.sleep(0.01)
        undo = _unwritable(ckpt)
        stdout, stderr = run.communicate(timeout=240)
    finally:
        if undo is not None:
            undo()
        if run.poll() is None:
            run.kill()
    said = stdout + stderr
    assert run.returncode != 0 and "Traceback" not in said, said
    assert "could not be saved: rank 0 could not write" in said and str(ckpt) in said, said
    assert "step 2000/2000" not in stdout
    latest = _latest(ckpt)
    assert (ckpt / latest / "index.json").is_file()  # latest names a complete checkpoint


def test_metrics_and_final_state_refuse_a_link_planted_during_the_run(tmp_path):
    out = tmp_path / "o"
    compile_model(PLANTING, Layout(tp=2), out=out)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    metrics, final = tmp_path / "m.jsonl", tmp_path / "final"
    final.mkdir()
    plant = f"{metrics}=>{victim}"
    run = _fxshard("run", out, "--steps", 1, "--metrics", metrics, env={"FXSHARD_TEST_PLANT": plant})
    assert metrics.is_symlink() and victim.read_text() == "precious\n"  # planted, never written through
    assert run.returncode != 0 and f"{metrics}: is a symbolic link" in run.stdout + run.stderr, run.stderr
    plant = f"{final / 'rank0.safetensors'}=>{victim}"
    run = _fxshard("run", out, "--steps", 1, "--final-state", final, env={"FXSHARD_TEST_PLANT": plant})
    assert victim.read_text() == "precious\n"
    assert run.returncode != 0 and "rank0.safetensors: is a symbolic link" in run.stdout + run.stderr, run.stderr
