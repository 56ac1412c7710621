"""``fxshard verify`` and ``fxshard run --memory-report`` end to end, on real local gloo processes."""

from __future__ import annotations

import re

import pytest
from test_e2e import ROOT, fxshard

from fxshard.driver import verify
from fxshard.ir.context import Layout


@pytest.mark.e2e
def test_verify_reports_losses_and_parameters_and_passes(tmp_path):
    run = fxshard("verify", ROOT / "samples" / "llama.py", "--tp", 2, "--steps", 2, "--out", tmp_path / "v")
    assert "single device vs tp=2" in run.stdout
    assert "trained parameters:" in run.stdout and re.search(r"of\s+the\s+update[^:]*:\s+OK", run.stdout)
    assert (tmp_path / "v" / "verify" / "final" / "rank1.safetensors").is_file()


@pytest.mark.e2e
def test_verify_exits_nonzero_above_the_tolerance(tmp_path):
    # dp=2 x pp=2 sums gradients in another order than one device: the losses differ by ~1e-7, not 0
    run = fxshard("verify", ROOT / "samples" / "gpt2.py", "--dp", 2, "--pp", 2, "--zero", 3, "--steps", 2,
                  "--rtol", 1e-12, check=False)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED" in run.stdout


@pytest.mark.e2e
def test_verify_gathers_every_parameter_from_tp_and_pp_slices(tmp_path):
    result = verify(ROOT / "samples" / "gpt.py", Layout(tp=2, pp=2), steps=2, out=tmp_path / "v")
    names = {p["fqn"] for p in result.params}
    assert "lm_head.weight" in names and "blocks.7.mlp.fc_in.weight" in names
    assert all(p["shape"] for p in result.params)
    assert result.ok, result.summary()
    assert result.loss_rel <= 1e-5 and result.param_rel <= 1e-3  # of the update training made


@pytest.mark.e2e
def test_run_memory_report_prints_measured_bytes_next_to_the_formula(tmp_path):
    out = tmp_path / "out"
    fxshard("compile", ROOT / "samples" / "gpt.py", "--dp", 2, "--zero", 1, "--dtype", "bf16", "--out", out)
    run = fxshard("run", out, "--steps", 1, "--memory-report")
    assert "ZeRO formula 4Ψ + 12Ψ/N" in run.stdout
    assert "1.000" in run.stdout  # measured / formula at ZeRO 1, mixed precision
