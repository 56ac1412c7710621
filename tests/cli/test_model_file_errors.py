"""Issue 32 items 9 and 14: a model file's own failures as one line, a transformers causal LM captured with its
default ``use_cache=True``, and the commands compile prints pasted into a shell as they are."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import cli as cli_process

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "tests" / "models" / "mlp.py"

CACHE_DEFAULT = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_model():  # use_cache left at its default, True
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64))


def make_inputs():  # no use_cache here either
    ids = torch.randint(0, 256, (4, 16))
    return {"input_ids": ids, "labels": ids.clone()}
'''


def cli(*args):
    from fxshard.cli.app import app
    from typer.testing import CliRunner

    return CliRunner().invoke(app, [str(a) for a in args])


# ---------------------------------------------------------------- item 9


@pytest.mark.parametrize("command", [["compile", "--out", "o"], ["plan"], ["verify", "--steps", "1"]])
def test_make_inputs_raising_is_one_line_like_make_model(tmp_path, command):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef make_model():\n    return torch.nn.Linear(4, 4)\n\n"
                   "def make_inputs():\n    raise ValueError('no data file')\n")
    args = [a if a != "o" else tmp_path / "o" for a in command]
    result = cli(args[0], bad, *args[1:])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: {bad}: make_inputs() raised ValueError: no data file; fix the model file (run make_inputs() on its "
        "own to see the traceback)"], result.stderr


def test_a_causal_lm_with_its_default_use_cache_is_captured_with_the_cache_off(tmp_path):
    model = tmp_path / "llama_cache.py"
    model.write_text(CACHE_DEFAULT)
    result = compile_model(model, Layout(tp=2), out=tmp_path / "o")
    # the cache is off inside the captured forward; the inputs are still the batch make_inputs() returns
    assert [i.path for i in result.manifest.inputs] == ["[1]['input_ids']", "[1]['labels']"]
    assert result.checks is not None


@pytest.mark.distributed
def test_a_causal_lm_captured_with_the_cache_off_trains_as_on_one_device(tmp_path):
    from fxshard.driver import verify

    model = tmp_path / "llama_cache.py"
    model.write_text(CACHE_DEFAULT)
    result = verify(model, Layout(tp=2), steps=2)
    assert result.ok, result.summary()


# ---------------------------------------------------------------- item 14


@pytest.mark.slow
def test_the_commands_compile_prints_paste_into_a_shell(tmp_path):
    out = tmp_path / "my out's [new] folder"
    proc = cli_process("compile", MLP, "--tp", 2, "--out", out, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    commands = re.findall(r"`(fxshard [^`]*)`", proc.stdout)
    assert [c.split()[1] for c in commands] == ["show", "run"], proc.stdout
    for command in commands:
        assert shlex.split(command)[2] == str(out)  # one word, exactly the folder
    show = commands[0].replace("fxshard", f"{shlex.quote(sys.executable)} -m fxshard.cli.app", 1)
    pasted = subprocess.run(["bash", "-c", show], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert pasted.returncode == 0 and "class RankModule" in pasted.stdout, pasted.stderr
