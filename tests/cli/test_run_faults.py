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

from fxshard.compiler import compile as compile_model
from fxshard.ir.context import Layout

MLP = Path(__file__).resolve().parents[1] / "models" / "mlp.py"


def _fxshard(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fxshard.cli.app", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


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
