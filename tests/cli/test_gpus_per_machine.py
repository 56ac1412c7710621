"""More ranks on a machine than it has GPUs is refused with one clear error before anything starts: NCCL runs one
rank per GPU, and otherwise answered with "Duplicate GPU detected" (or CUDA with "invalid device ordinal") from
inside the ranks.  No GPU lies under these tests: torch.cuda's count is set to what the machine would show, and
the check itself is the code under test (``scripts/gpu_check.sh`` runs the refusal on a real GPU:
benchmarks/results/nccl-refuse.log).  Each rank's own choice of GPU, and the refusal of two ranks on one GPU by
UUID, are tests/train/test_device.py's."""

from __future__ import annotations

import pytest
import torch

from fxshard.errors import LayoutError
from fxshard.train.device import SHARE_GPU
from fxshard.train.local import check_gpus, launch_local


def _gpus(monkeypatch, n: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n))))
    monkeypatch.delenv(SHARE_GPU, raising=False)


# in the fast tier, were the refusal to fail, torch's elastic launcher refuses to start the ranks (conftest.py)
def test_the_local_launcher_refuses_two_ranks_on_one_gpu_before_starting_them(monkeypatch, tmp_path):
    _gpus(monkeypatch, 1)
    with pytest.raises(LayoutError) as e:
        launch_local(tmp_path, ["run", str(tmp_path)], world=2)  # raises before the elastic agent starts
    message = str(e.value)
    assert message.startswith("the layout's 2 ranks would run as 2 processes on this machine, but this machine "
                              "shows 1 GPU (CUDA_VISIBLE_DEVICES=0): NCCL runs one rank per GPU."), message
    assert "torchrun --nproc-per-node 1 on 2 machines or more" in message
    assert "CUDA_VISIBLE_DEVICES= fxshard run" in message  # how to train on the CPU instead


def test_the_local_launcher_lets_ranks_share_a_gpu_when_asked(monkeypatch):
    _gpus(monkeypatch, 1)
    monkeypatch.setenv(SHARE_GPU, "1")
    check_gpus(4, 4, "the layout's 4 ranks would run as 4 processes on this machine")  # no refusal


def test_as_many_ranks_as_gpus_pass_and_cpu_runs_pass(monkeypatch):
    _gpus(monkeypatch, 2)
    check_gpus(2, 2, "the layout's 2 ranks")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_gpus(8, 8, "the layout's 8 ranks")  # gloo on the CPU: any number of ranks
