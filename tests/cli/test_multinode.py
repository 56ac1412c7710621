"""docs/multinode.md, tested: two torchrun "nodes" on this machine join by c10d rendezvous and train a compiled
folder as one local launch does, and two compiles of one model give byte-identical folders (so each node may compile
its own instead of copying one)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e import ROOT, fxshard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_two_compiles_give_byte_identical_folders(tmp_path):
    # as two nodes would: the same command and path, separate processes with different hash seeds
    out = tmp_path / "out"
    folders = []
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-m", "fxshard.cli.app", "compile", ROOT / "samples" / "llama.py",
                               "--tp", "2", "--pp", "2", "--out", out], capture_output=True, text=True, timeout=600,
                              cwd=ROOT, env=os.environ | {"PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        folders.append(_files(out))
        out.rename(tmp_path / f"node{seed}")
    first, second = folders
    assert sorted(first) == sorted(second)
    assert any(name.startswith("weights") for name in first) and "manifest.json" in first
    assert [n for n in first if first[n] != second[n]] == []


@pytest.mark.distributed
@pytest.mark.e2e
def test_torchrun_two_nodes_with_c10d_rendezvous_train_as_one_launch(tmp_path):
    out = tmp_path / "out"
    fxshard("compile", ROOT / "samples" / "gpt.py", "--tp", 2, "--out", out)
    fxshard("run", out, "--steps", 2, "--metrics", tmp_path / "local.jsonl")
    endpoint = f"127.0.0.1:{_free_port()}"
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "fxshard-test", "--local-addr",
         "127.0.0.1", "-m", "fxshard.cli.app", "run", str(out), "--steps", "2", "--metrics",
         str(tmp_path / "nodes.jsonl")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n\n".join(logs)
    # rank 0, on whichever node the rendezvous put it, wrote the metrics: the losses of one local launch, bit for bit
    local = [json.loads(x)["loss"] for x in (tmp_path / "local.jsonl").read_text().splitlines()]
    assert [json.loads(x)["loss"] for x in (tmp_path / "nodes.jsonl").read_text().splitlines()] == local
