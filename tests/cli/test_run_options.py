"""Every `fxshard run` option is checked before a process starts: a bad one is a one-line error naming the
option, and nothing is launched (before, most were found 12-15 s later inside the started ranks).  The command
runs in this process (``cli_in_process``): a refusal comes before any process would start."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_in_process import fxshard

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout

MLP = Path(__file__).resolve().parents[1] / "models" / "mlp.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlp")
    compile_model(MLP, Layout(tp=2), out=folder)
    return folder


def _run(*args):
    return fxshard("run", *args)


@pytest.mark.parametrize("args, says", [
    (["--grad-accum", "0"], "--grad-accum 0: expected at least 1"),
    (["--zero-bucket-mb", "0"], "--zero-bucket-mb 0.0: expected a positive size in MB"),
    (["--steps", "0"], "--steps 0: expected at least 1 step"),
    (["--steps", "-1"], "--steps -1: expected at least 1 step"),
    (["--lr", "nan"], "--lr nan: expected a finite learning rate"),
    (["--lr", "inf"], "--lr inf: expected a finite learning rate"),
    (["--beta2", "1.5"], "--beta2 1.5: expected a number in [0, 1)"),
    (["--timeout", "0"], "--timeout 0.0: expected a positive number of seconds"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm -1.0: expected a positive norm"),
    (["--metrics", "{tmp}/missing/m.jsonl"], "the folder {tmp}/missing does not exist"),
    (["--checkpoint", "{tmp}/a-file"], "is a file; --checkpoint names a folder"),
    (["--checkpoint", "{tmp}/empty", "--resume"], "no checkpoint here"),
    # names the file system refuses even to root (too long): before, rank 0's OSError traceback after launch
    (["--metrics", "{tmp}/" + "m" * 300], "cannot be written (File name too long)"),
    (["--checkpoint", "{tmp}/" + "c" * 300], "cannot be written (File name too long)"),
    (["--checkpoint", "{tmp}/a-file/ckpt"], "cannot be written (Not a directory)"),
    (["--final-state", "{tmp}/a-file"], "is a file; --final-state names a folder"),
    (["--metrics", "{out}/model.py"], "is model.py of the compiled folder"),  # was overwritten with JSON lines
    (["--metrics", "{out}/manifest.json"], "is manifest.json of the compiled folder"),
    (["--trace", "{tmp}/a-file"], "--trace {tmp}/a-file: is a file; --trace names a folder"),
    (["--trace", "{tmp}/missing/trace"], "the folder {tmp}/missing does not exist"),
    (["--trace", "{tmp}/" + "t" * 300], "cannot be written (File name too long)"),
])
def test_a_bad_option_is_refused_before_launch(out, tmp_path, args, says):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "empty").mkdir()
    args = [a.replace("{tmp}", str(tmp_path)).replace("{out}", str(out)) for a in args]
    before = {p: p.read_bytes() for p in out.glob("*") if p.is_file()}
    proc = _run(out, *args)
    assert {p: p.read_bytes() for p in out.glob("*") if p.is_file()} == before
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says.replace("{tmp}", str(tmp_path)) in proc.stderr and "Traceback" not in proc.stderr
    assert "launching" not in proc.stdout and "static checks" not in proc.stdout  # refused before anything ran


def test_a_launched_rank_parses_the_options_of_its_launcher():
    """Each option is declared once (RunOptions): the command line is made from it, and the arguments the
    launcher gives every rank parse back into the same options."""
    import typer
    from fxshard.cli.app import app

    from fxshard.train.optim import OptimConfig
    from fxshard.train.options import RunOptions

    optim = OptimConfig(lr=3e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, clip_grad_norm=1.0, grad_accum=2,
                        zero_bucket_mb=0.5, overlap_param_gather=False)
    options = RunOptions(steps=5, optim=optim, metrics=Path("m.jsonl"), timeout=60.0, memory_report=True,
                         final_state=Path("final"), checkpoint=Path("ckpt"), save_every=2, resume=True,
                         allow_edited=True, trace=Path("trace"))
    run = typer.main.get_command(app).commands["run"]
    assert RunOptions.from_flags(run.make_context("run", options.argv("out")[1:]).params) == options
    assert RunOptions.from_flags(run.make_context("run", ["out"]).params) == RunOptions()
    assert RunOptions().argv("out")[:4] == ["run", "out", "--steps", "3"]
