"""More ranks on a machine than it has GPUs is refused with one clear error before anything starts: NCCL runs one
rank per GPU, and otherwise answered with "Duplicate GPU detected" (or CUDA with "invalid device ordinal") from
inside the ranks.  No GPU lies under these tests: torch.cuda's count is set to what a one-GPU machine shows, and
the check itself is the code under test (``scripts/gpu_check.sh`` runs the refusal on a real GPU)."""

from __future__ import annotations

import pytest
import torch

from fxshard.errors import LayoutError
from fxshard.train.local import check_gpus, launch_local


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")


def test_the_local_launcher_refuses_two_ranks_on_one_gpu_before_starting_them(one_gpu, tmp_path):
    with pytest.raises(LayoutError) as e:
        launch_local(tmp_path, ["run", str(tmp_path)], world=2)  # raises before the elastic agent starts
    message = str(e.value)
    assert message.startswith("the layout's 2 ranks would run as 2 processes on this machine, but this machine "
                              "shows 1 GPU (CUDA_VISIBLE_DEVICES=0): NCCL runs one rank per GPU."), message
    assert "torchrun --nproc-per-node 1 on 2 machines or more" in message
    assert "CUDA_VISIBLE_DEVICES= fxshard run" in message  # how to train on the CPU instead


def test_a_torchrun_rank_names_itself_and_the_processes_on_its_machine(one_gpu):
    with pytest.raises(LayoutError, match=r"^rank 3: 4 processes run on this machine \(LOCAL_WORLD_SIZE\), but "
                                          r"this machine shows 1 GPU .*on 4 machines or more"):
        check_gpus(4, rank=3)


def test_as_many_ranks_as_gpus_and_cpu_runs_pass(monkeypatch, one_gpu):
    check_gpus(1)
    check_gpus(1, rank=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_gpus(8)  # gloo on the CPU: any number of ranks
