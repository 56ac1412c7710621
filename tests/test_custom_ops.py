"""Custom ops a model calls (``torch.ops.transformers.grouped_mm_fallback`` in Hugging Face MoE models) are
found at capture with the module that registers them; every rank file imports that module itself, so it
runs wherever it is loaded; ``check`` blames an edit only when a rank file was edited."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fxshard.capture.modelfile import load_model_file
from fxshard.capture.program import capture
from fxshard.check.check import AS_COMPILED, RECOMPILE, _fix_for
from fxshard.codegen.manifest import read_manifest
from fxshard.errors import CaptureError
from fxshard.testing import cli

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"


def fxshard(*args):
    proc = cli(*args, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"fxshard {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_mixtral_experts_op_is_traced_to_its_module():
    program = capture(load_model_file(MODELS / "hf_mixtral.py"))
    assert program.custom_ops == {"transformers::grouped_mm_fallback": "transformers.integrations.moe"}


def test_plain_model_has_no_custom_ops():
    assert capture(load_model_file(ROOT / "samples" / "gpt.py")).custom_ops == {}


def test_op_registered_in_the_model_file_is_refused_naming_it():
    with pytest.raises(CaptureError, match=r"fxshard_test\.scale_by_two, registered by the model file"):
        capture(load_model_file(MODELS / "custom_op_in_model.py"))


def test_check_blames_an_edit_only_when_a_rank_file_was_edited(tmp_path):
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    compile_model(MODELS / "mlp.py", Layout(tp=2), out=tmp_path)
    manifest = read_manifest(tmp_path)
    assert _fix_for(tmp_path, manifest) == AS_COMPILED
    rank = tmp_path / "rank_pp0_tp1.py"
    rank.write_text(rank.read_text() + "\n# edited\n")
    edited = _fix_for(tmp_path, manifest)
    assert edited.startswith("rank_pp0_tp1.py was changed after fxshard compile") and edited.endswith(RECOMPILE)


@pytest.mark.e2e
def test_mixtral_compiles_checks_and_runs_at_tp2(tmp_path):
    out = tmp_path / "out"
    fxshard("compile", MODELS / "hf_mixtral.py", "--tp", 2, "--out", out)
    assert read_manifest(out).custom_ops == {"transformers::grouped_mm_fallback": "transformers.integrations.moe"}
    source = (out / "rank_pp0_tp0.py").read_text()
    assert "import transformers.integrations.moe  # noqa: F401  registers " \
           "torch.ops.transformers.grouped_mm_fallback" in source
    # a rank file loads on its own: a fresh interpreter has no transformers op until it imports the file
    probe = ("import importlib.util, sys, torch\n"
             "assert not hasattr(torch.ops.transformers, 'grouped_mm_fallback')\n"
             f"spec = importlib.util.spec_from_file_location('r', {str(out / 'rank_pp0_tp0.py')!r})\n"
             "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
             "torch.ops.transformers.grouped_mm_fallback.default\n")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)
    assert "OK" in fxshard("check", out).stdout
    run = fxshard("run", out, "--steps", 2)
    assert "step 2/2" in run.stdout
