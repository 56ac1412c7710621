"""``fxshard.load(OUT)`` keeps ``fxshard run``'s promises (issue 45 items 10 and 13): a rank file edited after the
compile is refused before any of it runs (``allow_edited=True`` runs it), and a process that is no rank of a job
gets one line saying how to start one, not ``KeyError: 'RANK'``.  The edit is a real one: a line that, if it ran,
would leave a file behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import fxshard
from fxshard.driver import compile as compile_model
from fxshard.errors import FxshardError, OutputFolderError
from fxshard.ir.context import Layout

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def edited(tmp_path):
    out = tmp_path / "gpt"
    compile_model(ROOT / "samples" / "gpt.py", Layout(), out=out)
    marker = tmp_path / "the-edit-ran"
    rank = out / "rank_pp0_tp0.py"
    rank.write_text(f"open({str(marker)!r}, 'w').close()\n" + rank.read_text())
    return out, marker


def test_load_refuses_an_edited_rank_file_before_running_it(edited, monkeypatch):
    out, marker = edited
    for key in TORCHRUN:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(OutputFolderError, match=r"rank_pp0_tp0.py differs from what fxshard compile wrote .* pass "
                                                r"allow_edited=True to fxshard.load"):
        fxshard.load(out)
    assert not marker.exists()
    with pytest.raises(FxshardError, match=r"runs as one rank of a distributed job, and this process is none \(RANK "
                                           r"and WORLD_SIZE are not set\): start the script with torchrun "
                                           r"--nproc-per-node 1"):
        fxshard.load(out, allow_edited=True)  # past the digests: to the next refusal, still before any import
    assert not marker.exists()


@pytest.mark.distributed
def test_load_with_allow_edited_runs_the_edited_file(edited):
    out, marker = edited
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    code = (f"import fxshard, torch.distributed as dist; fxshard.load({str(out)!r}, allow_edited=True); "
            "dist.destroy_process_group()")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert marker.exists()
