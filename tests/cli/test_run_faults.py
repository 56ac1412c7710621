"""Runs that go wrong stop and say so: a non-finite loss ends the run at its step with a non-zero exit, and a
resumed run appends to its metrics file instead of truncating it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import cli

MLP = Path(__file__).resolve().parents[1] / "models" / "mlp.py"


def _fxshard(*args, timeout=300):
    return cli(*args, timeout=timeout)


@pytest.mark.e2e
def test_nan_weights_stop_the_run_at_the_first_step(tmp_path):
    out = tmp_path / "o"
    compile_model(MLP, Layout(tp=2), out=out)
    for shard in (out / "weights").iterdir():
        tensors = load_file(str(shard))
        key = next(k for k in tensors if k.endswith("fc_in_weight"))
        tensors[key] = torch.full_like(tensors[key], float("nan"))
        save_file(tensors, str(shard), metadata={"format": "pt"})
    run = _fxshard("run", out, "--steps", 3, "--no-check", "--timeout", 60)
    assert run.returncode != 0
    assert "step 1: the loss is nan" in run.stdout + run.stderr
    assert "step 2/3" not in run.stdout


@pytest.mark.e2e
def test_a_resumed_run_appends_to_its_metrics(tmp_path):
    out, ckpt, metrics = tmp_path / "o", tmp_path / "ckpt", tmp_path / "m.jsonl"
    compile_model(MLP, Layout(tp=2), out=out)
    first = _fxshard("run", out, "--steps", 2, "--checkpoint", ckpt, "--save-every", 1, "--metrics", metrics)
    assert first.returncode == 0, first.stdout + first.stderr
    again = _fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume", "--metrics", metrics)
    assert again.returncode == 0, again.stdout + again.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder trained 2 steps with a checkpoint after each: ckpt/step-00000001, step-00000002, latest."""
    root = tmp_path_factory.mktemp("saved")
    out, ckpt = root / "o", root / "ckpt"
    compile_model(MLP, Layout(tp=2), out=out)
    run = _fxshard("run", out, "--steps", 2, "--checkpoint", ckpt, "--save-every", 1)
    assert run.returncode == 0, run.stdout + run.stderr
    return out, ckpt


def _copy(saved, tmp_path):
    import shutil

    out, ckpt = saved
    shutil.copytree(ckpt, tmp_path / "ckpt")
    return out, tmp_path / "ckpt"


@pytest.mark.e2e
@pytest.mark.parametrize("damage", ["truncate", "header", pytest.param("remove", marks=pytest.mark.matrix)])
def test_a_damaged_checkpoint_is_named_before_launch_and_by_export(saved, tmp_path, damage):
    out, ckpt = _copy(saved, tmp_path)
    shard = ckpt / "step-00000002" / "shard-pp0-tp1.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "header":
        shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + shard.read_bytes()[24:])
    else:
        shard.unlink()
    run = _fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume")
    assert run.returncode == 2 and "shard-pp0-tp1.safetensors" in run.stderr and "launching" not in run.stdout
    # and how to go on: the complete step before it, and how to point latest at it
    assert f"resume from step-00000001, the newest complete step before it: echo step-00000001 > {ckpt / 'latest'}" \
        in run.stderr, run.stderr
    export = _fxshard("export", ckpt, "--hf", tmp_path / "hf")
    assert export.returncode == 2 and "shard-pp0-tp1.safetensors" in export.stderr
    assert "Traceback" not in run.stderr + export.stderr


@pytest.mark.e2e
def test_export_refuses_an_edited_model_copy_before_running_it(saved, tmp_path):
    out, ckpt = _copy(saved, tmp_path)
    copy = ckpt / "step-00000002" / "model.py"
    ran = tmp_path / "ran"
    copy.write_text(copy.read_text() + f"\nopen({str(ran)!r}, 'w').write('ran')\n")
    export = _fxshard("export", ckpt, "--hf", tmp_path / "hf")
    assert export.returncode == 2 and f"{copy}: differs from the model file this checkpoint was saved with" in \
        export.stderr, export.stderr
    assert not ran.exists() and "Traceback" not in export.stderr
    trusted = _fxshard("export", ckpt, "--hf", tmp_path / "hf", "--model", MLP)  # the override
    assert trusted.returncode == 0, trusted.stdout + trusted.stderr


@pytest.mark.e2e
def test_latest_naming_a_step_without_index_falls_back_to_the_previous_one(saved, tmp_path):
    out, ckpt = _copy(saved, tmp_path)
    (ckpt / "step-00000002" / "index.json").unlink()  # as if killed between writing the shards and the index
    run = _fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "using step-00000001, the newest complete checkpoint" in run.stdout
    assert "step 2/3" in run.stdout and "step 3/3" in run.stdout  # resumed after step 1


@pytest.mark.e2e
def test_a_run_leaves_no_temporary_folder_behind(tmp_path):
    import os

    out, tmp = tmp_path / "o", tmp_path / "tmp"
    tmp.mkdir()
    compile_model(MLP, Layout(tp=2), out=out)
    # as a user's shell has it: this test process imported torch's compiler, which exports TORCHINDUCTOR_CACHE_DIR
    # (a child would then not touch TMPDIR at all, and the test would prove nothing)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"TMPDIR": str(tmp)}
    left = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-m", "fxshard.cli.app", "run", str(out), "--steps", "1"],
                             capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        left.append(sorted(p.name for p in tmp.iterdir()))
    # torch's per-user compile cache (made when torch._dynamo is imported, reused by every later process) is
    # torch's own; no run leaves a folder of its own (torchelastic_*, fxshard-run-*), so nothing piles up
    assert all(name.startswith("torchinductor_") for name in left[1]), left
    assert left[0] == left[1]
