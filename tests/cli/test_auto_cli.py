"""``fxshard plan --auto``, ``fxshard plan --hardware`` and ``fxshard compile --auto`` through the command line (in
process), and their refusals before any capture."""

from __future__ import annotations

import json

import pytest

from tests.cli_in_process import fxshard

MODEL = "samples/llama.py"


@pytest.mark.e2e
def test_plan_auto_ranks_layouts_and_prints_the_command_that_compiles_the_first():
    done = fxshard("plan", MODEL, "--auto", "--gpus", "4", "--hardware", "cpu-gloo", "--top", "3")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "fxshard plan --auto" in out and "predicted step" in out and "tokens/s per device" in out
    assert "MFU" in out and "searched" in out and "compile it: fxshard compile samples/llama.py" in out


@pytest.mark.slow  # two searches over every layout: 8.8 s alone
def test_plan_auto_searches_in_the_profiles_dtype_without_dtype_and_says_so():
    done = fxshard("plan", MODEL, "--auto", "--gpus", "2", "--hardware", "h100", "--top", "2")
    assert done.returncode == 0, done.stderr
    assert "searched in bf16" in done.stdout and "--dtype bf16" in done.stdout  # the note, and the compile line
    done = fxshard("plan", MODEL, "--auto", "--gpus", "2", "--hardware", "h100", "--dtype", "fp32", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dtype"] == "fp32"


@pytest.mark.e2e
def test_plan_auto_json_and_compile_auto_compiles_the_winner(tmp_path):
    done = fxshard("plan", MODEL, "--auto", "--gpus", "2", "--hardware", "h100", "--dtype", "bf16", "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["gpus"] == 2 and found["ranked"][0]["fits"] and found["ranked"][0]["step_s"] > 0
    assert found["dtype"] == "bf16"
    assert [r["step_s"] for r in found["ranked"]] == sorted(r["step_s"] for r in found["ranked"])
    out = tmp_path / "auto"
    done = fxshard("compile", MODEL, "--auto", "--gpus", "2", "--hardware", "h100", "--dtype", "bf16", "--out", out)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert found["ranked"][0]["layout"] in done.stdout
    assert json.dumps(manifest)  # the winner compiled


@pytest.mark.e2e
def test_plan_hardware_states_the_time_model_of_the_layout():
    done = fxshard("plan", MODEL, "--tp", "2", "--hardware", "cpu-gloo")
    assert done.returncode == 0, done.stderr
    for words in ("time model on", "compute", "exposed communication", "tp ", "pipeline bubble", "predicted step",
                  "tokens/s per device", "MFU"):
        assert words in done.stdout, words


@pytest.mark.parametrize("args,says", [
    (["--auto", "--hardware", "h100"], "expected --gpus N"),
    (["--auto", "--gpus", "4"], "expected --hardware PROFILE"),
    (["--auto", "--gpus", "4", "--hardware", "h100", "--tp", "2"], "--auto chooses the layout itself; found --tp"),
    (["--auto", "--gpus", "0", "--hardware", "h100"], "--gpus must be at least 1"),
    (["--auto", "--gpus", "12", "--gpus-per-node", "8", "--hardware", "h100"], "expected whole nodes"),
    (["--auto", "--gpus", "4", "--hardware", "nosuch"], "expected a profile name"),
    (["--gpus", "4"], "--gpus is for --auto"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--global-batch", "4", "--batch", "2"], "--global-batch is the old name of --batch"),
    (["--gpus-per-node", "4"], "expected --hardware too"),
    (["--hardware", "nosuch"], "expected a profile name"),
])
def test_bad_auto_options_are_refused_before_capture(args, says):
    done = fxshard("plan", MODEL, *args)
    assert done.returncode == 2 and says in done.stderr, done.stderr


def test_compile_refuses_auto_flags_without_auto(tmp_path):
    done = fxshard("compile", MODEL, "--hardware", "h100", "--out", tmp_path / "o")
    assert done.returncode == 2 and "without --auto" in done.stderr


def test_a_profile_with_missing_fields_is_refused_naming_them(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"peak_flops": {"fp32": 1e12}}))
    done = fxshard("plan", MODEL, "--auto", "--gpus", "2", "--hardware", path)
    assert done.returncode == 2 and "memory_bandwidth" in done.stderr and "inter_node" in done.stderr
