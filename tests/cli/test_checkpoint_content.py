"""A checkpoint proves its content, and a resume continues the run it saved (issue 45 items 7, 8, 13-16).

- a resume given other data (another token file of the same size, ``--data-seed``, ``--no-shuffle``) is refused
  before launch, naming what changed; ``--allow-data-change`` continues with the data given, its flags honoured;
- a flipped exponent bit in 64 values of one tensor is named, with its file, at resume and at export; a shard copied
  from another file is refused before launch;
- an index's hand-edited values (a step of ``"three"``, a data position of -5 or 10**30) are one line each;
- a step none of whose positions has a label stops the run by name, even under ``--on-nonfinite skip``;
- a rank that refuses in its own checks (under torchrun, or the launcher's race with another run) is named with its
  refusal in the summary, not torch's boilerplate.

Every run is ``fxshard run`` in its own process: samples/llama.py at tp=2 on a token file of a generated corpus."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import cli
from fxshard.train.data.synthetic import train_tokenizer, write_corpus
from fxshard.train.data.tokenize import tokenize

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "samples" / "llama.py"


def _fxshard(*args, env=None):
    return cli(*args, timeout=600, cwd=ROOT, env=None if env is None else os.environ | env)


def _refused(done) -> str:
    assert done.returncode == 2 and "launching" not in done.stdout and "Traceback" not in done.stderr, \
        done.stdout + done.stderr
    return " ".join(done.stderr.split())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tp=2 Llama trained 2 steps on ``a.bin``, checkpointed at step 2: ``(root, out, checkpoint)``."""
    root = tmp_path_factory.mktemp("content")
    write_corpus(root / "corpus", 300, sentences=(1, 3))
    train_tokenizer(root / "corpus", root / "tok", vocab=256)
    tokenize(root / "corpus", root / "tok", root / "a.bin")
    out = root / "out"
    compile_model(LLAMA, Layout(tp=2), out=out)
    run = _fxshard("run", out, "--steps", 2, "--data", root / "a.bin", "--checkpoint", root / "ckpt", "--save-every", 2)
    assert run.returncode == 0, run.stdout + run.stderr
    return root, out, root / "ckpt"


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    shutil.copytree(ckpt, tmp_path / "ckpt", symlinks=True)
    return tmp_path / "ckpt"


def test_a_resume_given_other_data_is_refused_unless_allowed(trained, tmp_path):
    root, out, ckpt = trained
    ckpt = _copy(ckpt, tmp_path)
    for suffix in (".idx", ".json"):
        shutil.copy(root / f"a{suffix}", tmp_path / f"b{suffix}")
    ids = np.fromfile(root / "a.bin", dtype=np.uint16)
    ids[100] = (ids[100] + 1) % 256  # one token of another file of the same size
    ids.tofile(tmp_path / "b.bin")
    # --no-check: the static check of the program is another test's (seconds each); these refusals read the data
    said = _refused(_fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume", "--data", tmp_path / "b.bin",
                             "--no-check"))
    assert "resumed with other data than it trained on: the token file is another" in said
    assert "pass --allow-data-change" in said
    said = _refused(_fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume", "--data", root / "a.bin",
                             "--data-seed", 7, "--no-check"))
    assert "--data-seed 7 (saved: 0)" in said
    said = _refused(_fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume", "--data", root / "a.bin",
                             "--no-shuffle", "--no-check"))
    assert "--shuffle False (saved: True)" in said
    run = _fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume", "--save-every", 1, "--data",
                   root / "a.bin", "--data-seed", 7, "--no-shuffle", "--allow-data-change", "--no-check")
    assert run.returncode == 0, run.stdout + run.stderr
    state = json.loads((ckpt / "step-00000003" / "index.json").read_text())["trainer"]["data"]
    assert state["seed"] == 7 and state["shuffle"] is False and state["position"] == 12  # the flags were honoured


def _flip(shard: Path, key_prefix: str, count: int = 64) -> str:
    """Flip the top exponent bit of the first ``count`` float32 values of the tensor whose key starts so."""
    raw = bytearray(shard.read_bytes())
    length = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + length])
    key = next(k for k in header if k.startswith(key_prefix))
    start = 8 + length + header[key]["data_offsets"][0]
    for i in range(count):
        raw[start + 4 * i + 3] ^= 0x40
    shard.write_bytes(bytes(raw))
    return key


def test_a_flipped_bit_is_named_at_resume_and_at_export(trained, tmp_path):
    root, out, ckpt = trained
    ckpt = _copy(ckpt, tmp_path)
    key = _flip(ckpt / "step-00000002" / "shard-pp0-tp0.safetensors", "lm_head.weight|param")
    run = _fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume", "--data", root / "a.bin")
    said = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0 and "distributed run failed" in said, said
    assert f"shard-pp0-tp0.safetensors: tensor '{key}' differs from what was saved" in said
    said = _refused(_fxshard("export", ckpt, "--hf", tmp_path / "hf"))
    assert f"tensor '{key}' differs from what was saved" in said and not (tmp_path / "hf").exists()


def test_a_shard_of_another_file_is_refused_before_launch(trained, tmp_path):
    root, out, ckpt = trained
    ckpt = _copy(ckpt, tmp_path)
    step = ckpt / "step-00000002"
    shutil.copy(step / "shard-pp0-tp1.safetensors", step / "shard-pp0-tp0.safetensors")  # same size, another file
    said = _refused(_fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume", "--data", root / "a.bin"))
    assert "shard-pp0-tp0.safetensors: its header (tensor names, offsets, digests) differs from the one the index " \
           "recorded" in said


@pytest.mark.parametrize("edit, said", [
    (lambda index: index.update(step="three"), "step 'three'; expected the number of steps trained"),
    (lambda index: index["trainer"]["data"].update(position=-5), "data position -5; expected the examples consumed"),
    (lambda index: index["trainer"]["data"].update(position=10**30),
     "data position 1,000,000,000,000,000,000,000,000,000,000, past the 2 global batches of 4"),
])
def test_a_hand_edited_index_value_is_one_line(trained, tmp_path, edit, said):
    root, out, ckpt = trained
    ckpt = _copy(ckpt, tmp_path)
    path = ckpt / "step-00000002" / "index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))
    assert said in _refused(_fxshard("run", out, "--steps", 3, "--checkpoint", ckpt, "--resume", "--data",
                                     root / "a.bin"))


def test_a_step_with_no_label_stops_the_run_by_name_even_when_skipping(tmp_path):
    model = tmp_path / "nolabels.py"
    model.write_text(LLAMA.read_text() + (
        "\n\ndef make_batches():\n    batch = make_inputs()\n"
        "    batch['labels'] = torch.full_like(batch['labels'], -100)"
        "\n    return [batch]\n"))
    compile_model(model, Layout(), out=tmp_path / "out")
    run = _fxshard("run", tmp_path / "out", "--steps", 2, "--on-nonfinite", "skip")
    said = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0 and "step 1: no position of its batches has a label" in said, said


def test_a_ranks_own_refusal_under_torchrun_is_its_summary_not_torchs_boilerplate(trained, tmp_path):
    """A rank refuses in its own checks (here: the folder holds another run's checkpoints, as when a second run's
    ranks start after the first one saved); its message must reach the launcher's summary."""
    root, out, ckpt = trained
    ckpt = _copy(ckpt, tmp_path)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "fxshard.cli.app", "run", str(out), "--steps", "3", "--checkpoint", str(ckpt),
                           "--save-every", "1", "--data", str(root / "a.bin")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    summary = done.stderr[done.stderr.find("Root Cause"):] if "Root Cause" in done.stderr else done.stderr
    assert done.returncode != 0 and "CheckpointError: --checkpoint" in summary, done.stderr
    assert "holds an earlier run's checkpoints" in summary and "To enable traceback" not in summary
