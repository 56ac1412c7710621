"""More ranks on a machine than it has GPUs is refused with one clear error before anything starts: NCCL runs one
rank per GPU, and otherwise answered with "Duplicate GPU detected" (or CUDA with "invalid device ordinal") from
inside the ranks.  No GPU lies under these tests: torch.cuda's count is set to what the machine would show, and
the check itself is the code under test (``scripts/gpu_check.sh`` runs the refusal on a real GPU:
benchmarks/results/nccl-refuse.log)."""

from __future__ import annotations

import pytest
import torch

from fxshard.errors import LayoutError
from fxshard.train.launch import _check_local_gpu
from fxshard.train.local import check_gpus, launch_local


def _gpus(monkeypatch, n: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n))))


def test_the_local_launcher_refuses_two_ranks_on_one_gpu_before_starting_them(monkeypatch, tmp_path):
    _gpus(monkeypatch, 1)
    with pytest.raises(LayoutError) as e:
        launch_local(tmp_path, ["run", str(tmp_path)], world=2)  # raises before the elastic agent starts
    message = str(e.value)
    assert message.startswith("the layout's 2 ranks would run as 2 processes on this machine, but this machine "
                              "shows 1 GPU (CUDA_VISIBLE_DEVICES=0): NCCL runs one rank per GPU."), message
    assert "torchrun --nproc-per-node 1 on 2 machines or more" in message
    assert "CUDA_VISIBLE_DEVICES= fxshard run" in message  # how to train on the CPU instead


def test_a_torchrun_rank_names_itself_and_the_machines_the_whole_world_needs(monkeypatch):
    _gpus(monkeypatch, 2)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(LayoutError, match=r"^rank 11: 4 processes run on this machine \(LOCAL_WORLD_SIZE\), but "
                                          r"this machine shows 2 GPUs .*--nproc-per-node 2 on 8 machines or more"):
        _check_local_gpu(11)


def test_a_rank_without_local_rank_says_its_rank_was_taken_for_the_gpu(monkeypatch):
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(LayoutError, match=r"^rank 1: LOCAL_RANK is not set, so its rank 1 is taken as its GPU index"):
        _check_local_gpu(1)


def test_as_many_ranks_as_gpus_pass_on_every_machine_and_cpu_runs_pass(monkeypatch):
    _gpus(monkeypatch, 2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # two machines of two GPUs each, under torchrun
    for local in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert _check_local_gpu(2 + local) == local
    check_gpus(2, 2, "the layout's 2 ranks")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_gpus(8, 8, "the layout's 8 ranks")  # gloo on the CPU: any number of ranks
