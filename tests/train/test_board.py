"""``fxshard run --tensorboard DIR`` (``fxshard/train/board.py``): the event file read back holds, at every step the
``--metrics`` JSONL records, the same loss, learning rate, gradient norm, tokens/s and evaluation loss; the gradient
norm at tp=2 is one device's; the refusals before launch."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from cli_in_process import fxshard

from fxshard.capture.modelfile import load_model_file
from fxshard.errors import OptionError
from fxshard.files import UnsafePathError
from fxshard.testing import cli
from fxshard.train.board import TAGS, Board, check_tensorboard
from fxshard.train.reference import reference_losses

ROOT = Path(__file__).resolve().parents[2]


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Tag -> step -> value, read from the event files in ``folder`` by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_a_record_is_written_at_its_step_and_read_back(tmp_path):
    board = Board(tmp_path / "tb", first_step=1)
    board.write({"step": 1, "loss": 5.5, "lr": 3e-4, "grad_norm": 1.25, "seconds": 0.5, "tokens": 64})
    board.write({"step": 2, "loss": 5.0, "lr": 2e-4, "grad_norm": float("nan"), "seconds": 0.25, "tokens": 64,
                 "eval_loss": 5.25, "skipped": True})
    board.close()
    got = _scalars(tmp_path / "tb")
    assert got[TAGS["loss"]] == {1: 5.5, 2: 5.0}
    assert got[TAGS["tokens_per_s"]] == {1: 128.0, 2: 256.0}
    assert got[TAGS["eval_loss"]] == {2: 5.25}
    assert got[TAGS["grad_norm"]] == {1: 1.25}  # a skipped step's non-finite norm is not drawn
    assert math.isclose(got[TAGS["lr"]][1], 3e-4, rel_tol=1e-6)


def test_refused_before_launch_naming_the_fix(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OptionError, match=r"--tensorboard .*file: is a file; --tensorboard names a folder"):
        check_tensorboard(tmp_path / "file")
    with pytest.raises(OptionError, match=r"the folder .*nowhere does not exist; create it first"):
        check_tensorboard(tmp_path / "nowhere" / "tb")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UnsafePathError, match=r"is a symbolic link .* the TensorBoard events"):
        check_tensorboard(tmp_path / "link")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed
    with pytest.raises(OptionError, match=r"needs the tensorboard package, .* pip install 'fxshard\[tensorboard\]'"):
        check_tensorboard(tmp_path / "tb")


def test_run_refuses_a_tensorboard_file_before_it_launches(tmp_path):
    out = tmp_path / "out"
    assert fxshard("compile", ROOT / "tests" / "models" / "mlp.py", "--out", out).returncode == 0
    (tmp_path / "tb").write_text("x")
    done = fxshard("run", out, "--steps", 1, "--tensorboard", tmp_path / "tb")
    assert done.returncode == 2 and "is a file; --tensorboard names a folder" in done.stderr


# make test-matrix's (a tp2 run of 4 steps with evaluation, then one device's): what the board draws from the
# records is this file's first test, the global gradient norm against one device's
# tests/test_expert_parallel.py::test_global_gradient_norm_counts_each_expert_gradient_once
@pytest.mark.e2e
@pytest.mark.matrix
def test_run_writes_what_the_metrics_record_and_the_gradient_norm_is_one_devices(tmp_path, corpus):
    root, _ = corpus
    out, metrics, board = tmp_path / "out", tmp_path / "m.jsonl", tmp_path / "tb"
    model = ROOT / "tests" / "models" / "packed_llama.py"
    assert fxshard("compile", model, "--tp", 2, "--out", out).returncode == 0
    done = cli("run", out, "--steps", 4, "--data", root / "t.bin", "--eval-every", 2, "--eval-batches", 1,
               "--lr", 1e-3, "--lr-schedule", "cosine", "--warmup-steps", 1, "--metrics", metrics,
               "--tensorboard", board)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    got = _scalars(board)
    assert len(list(board.glob("events.out.tfevents.*"))) == 1  # rank 0 only
    for r in records:
        for key in ("loss", "lr", "grad_norm", "eval_loss"):
            if key in r:
                assert math.isclose(got[TAGS[key]][r["step"]], r[key], rel_tol=1e-6), (key, r)
        assert math.isclose(got[TAGS["tokens_per_s"]][r["step"]], r["tokens"] / r["seconds"], rel_tol=1e-6)
    assert sorted(got[TAGS["eval_loss"]]) == [2, 4] and sorted(got[TAGS["loss"]]) == [1, 2, 3, 4]
    # the global gradient norm, every tp shard counted once, is the norm one device computes
    from fxshard.train.data import DataOptions
    from fxshard.train.optim import OptimConfig

    mf = load_model_file(model)
    grad_sq: dict = {}
    reference_losses(mf, 4, OptimConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=1),
                     data=DataOptions(data=root / "t.bin"), grad_sq=grad_sq)
    names = dict(mf.build_model(0).named_parameters())  # each tied weight once
    for step, r in enumerate(records):
        want = math.sqrt(sum(grad_sq[n][step] for n in names))
        assert math.isclose(r["grad_norm"], want, rel_tol=1e-5), (step, r["grad_norm"], want)
