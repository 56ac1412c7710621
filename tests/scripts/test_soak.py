"""scripts/soak.py's short version as a test: 60 steps of samples/gpt.py at tp=2·dp=2, a save every 10, a rank
killed with SIGKILL 3 times and resumed; the final checkpoint equals the uninterrupted run's bit for bit and no
process the soak started is left.  The long version is `make soak` (2,000 steps, 10 kills)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxshard.train.checkpoint import CheckpointReader

ROOT = Path(__file__).resolve().parents[2]


def _started_by(tmpdir: Path) -> list[int]:
    """Live processes whose environment carries the soak's own TMPDIR: every process it started, however
    reparented."""
    mark = f"TMPDIR={tmpdir}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # not a zombie
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


@pytest.mark.e2e
@pytest.mark.matrix  # make test-matrix and make soak; make test kills and resumes in tests/train/test_resume_killed.py
def test_short_soak_kills_three_ranks_and_ends_bit_identical_with_no_orphans(tmp_path):
    work = tmp_path / "soak"
    proc = subprocess.run([sys.executable, "scripts/soak.py", "--steps", "60", "--kills", "3", "--save-every", "10",
                           "--no-check", "--seed", "1", "--work",
                           str(work)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((work / "soak.json").read_text())
    assert r["resumes"] == 3 and all(k["pid"] and k["after_step"] >= k["target"] for k in r["kills"]), r["kills"]
    assert r["steps_trained"] > 60  # the steps lost to the kills were trained again

    # the two final checkpoints, read here: every parameter and its Adam state, bit for bit
    ref, soak = CheckpointReader(work / "ref-ckpt"), CheckpointReader(work / "soak-ckpt")
    assert ref.step == soak.step == 60 and ref.index["trainer"] == soak.index["trainer"]
    assert set(ref.sources) == set(soak.sources)
    for fqn in ref.sources:
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            a, b = ref.tensor(fqn, kind), soak.tensor(fqn, kind)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (fqn, kind)

    # no orphan: no process carrying the soak's TMPDIR is alive (the killed ranks' peers, the launchers, their children)
    assert r["orphans"] == [] and r["stray"] == [], (r["orphans"], r["stray"])
    # checksums on: every kept step read back through its digests, and what they cost said
    assert r["damaged"] == [] and r["tensors_verified"] > 0 and r["checksum_cost"]["hash_s"] > 0, r["damaged"]
    assert _started_by(work / "tmp") == []
