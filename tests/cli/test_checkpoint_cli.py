"""Tier 3: ``fxshard run --checkpoint/--save-every/--resume`` and ``fxshard export`` from the command line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.testing import cli
from fxshard.train.checkpoint import CRASH_ENV, CheckpointReader
from fxshard.train.reference import reference_losses

ROOT = Path(__file__).resolve().parents[2]


def fxshard(*args, check=True, env=None):
    proc = cli(*args, timeout=600, cwd=ROOT, env=os.environ | (env or {}))
    if check and proc.returncode != 0:
        raise AssertionError(f"fxshard {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


# make test-matrix: a crash mid-save resumed is make test's tests/cli/test_supervision.py (a worker killed -9 mid-save,
# then resumed) and tests/train/test_resume_killed.py (the resumed losses bit for bit); an export to the transformers
# class, tests/test_frozen.py's and tests/test_moe_tensor_parallel.py's
@pytest.mark.e2e
@pytest.mark.matrix
def test_killed_mid_save_then_resume_then_export(tmp_path):
    from transformers import AutoModelForCausalLM

    out, ckpt, hf = tmp_path / "out", tmp_path / "ckpt", tmp_path / "hf"
    fxshard("compile", ROOT / "samples" / "llama.py", "--tp", 2, "--out", out)
    crashed = fxshard("run", out, "--steps", 4, "--checkpoint", ckpt, "--save-every", 2, check=False,
                      env={CRASH_ENV: "4"})  # rank 0 exits in the middle of the step-4 save
    assert crashed.returncode != 0 and "distributed run failed" in crashed.stderr, crashed.stderr
    assert (ckpt / "latest").read_text().strip() == "step-00000002"
    run = fxshard("run", out, "--steps", 4, "--checkpoint", ckpt, "--save-every", 2, "--resume",
                  "--metrics", tmp_path / "m.jsonl")
    assert "step 3/4" in run.stdout and "step 1/4" not in run.stdout
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [3, 4]
    want = reference_losses(load_model_file(ROOT / "samples" / "llama.py"), 4)[2:]
    for got, ref in zip([x["loss"] for x in lines], want, strict=True):
        assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    exported = fxshard("export", ckpt, "--hf", hf)
    assert "step-00000004" in exported.stdout
    model = AutoModelForCausalLM.from_pretrained(hf)
    reader = CheckpointReader(ckpt)
    assert reader.step == 4
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), reader.tensor(name)), name


def test_checkpoint_flag_errors(tmp_path):
    from cli_in_process import fxshard  # refused before anything starts: in this process

    bad = fxshard("run", tmp_path, "--resume")
    assert bad.returncode == 2 and "--resume needs --checkpoint DIR" in bad.stderr
    missing = fxshard("export", tmp_path, "--hf", tmp_path / "hf")
    assert missing.returncode == 2 and "no checkpoint here" in missing.stderr
