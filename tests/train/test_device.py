"""A rank's GPU as torchrun's and SLURM's users expect, and two ranks on one GPU found by UUID.

No GPU lies under these tests: the environment (LOCAL_RANK, CUDA_VISIBLE_DEVICES) is a dict, the count of visible
GPUs an argument, and each rank's GPU UUID a function given to the check; the store the ranks exchange UUIDs through
is the real one of a real gloo process group.  ``scripts/gpu_check.sh`` runs the same code on a GPU
(benchmarks/results/nccl-refuse.log, nccl-matrix.log)."""

from __future__ import annotations

import os

import pytest
import torch

from fxshard.errors import LayoutError
from fxshard.testing import spawn
from fxshard.train import device as dev
from fxshard.train.device import SHARE_GPU, choose_gpu, pose_as_own_host, refuse_shared, shared_gpus


def test_srun_gpus_per_task_gives_each_process_its_one_visible_gpu():
    # srun --gpus-per-task=1: each process sees one GPU (device 0) and has a LOCAL_RANK above 0
    for local in range(4):
        env = {"LOCAL_RANK": str(local), "CUDA_VISIBLE_DEVICES": str(local), "SLURM_LOCALID": str(local)}
        assert choose_gpu(4 + local, visible=1, env=env) == 0


def test_torchrun_takes_local_rank_and_a_hand_started_rank_its_rank():
    assert [choose_gpu(8 + r, 8, {"LOCAL_RANK": str(r)}) for r in range(8)] == list(range(8))
    assert choose_gpu(1, 2, {}) == 1  # one machine, started by hand: RANK is the index


def test_a_local_rank_past_the_visible_gpus_is_refused_naming_how_it_was_chosen():
    with pytest.raises(LayoutError, match=r"^rank 11: its LOCAL_RANK 3 asks for GPU 3, but this process sees 2 GPUs "
                                          r"\(CUDA_VISIBLE_DEVICES=0,1\).*torchrun --nproc-per-node 2"):
        choose_gpu(11, 2, {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(LayoutError, match=r"^rank 2: LOCAL_RANK is not set, so its rank 2 is taken as its GPU index"):
        choose_gpu(2, 2, {})
    with pytest.raises(LayoutError, match=r"^rank 0: NCCL needs a GPU and this process sees none"):
        choose_gpu(0, 0, {"CUDA_VISIBLE_DEVICES": ""})


def test_sharing_wraps_the_local_rank_round_the_visible_gpus():
    assert choose_gpu(3, 2, {"LOCAL_RANK": "3", SHARE_GPU: "1"}) == 1


def test_shared_gpus_are_found_by_uuid_not_by_count():
    # two machines whose CUDA_VISIBLE_DEVICES both name one GPU each: four ranks, four indices 0, but two GPUs
    assert shared_gpus({0: "GPU-a n1", 1: "GPU-b n1", 2: "GPU-c n2", 3: "GPU-d n2"}) == {}
    assert shared_gpus({0: "GPU-a n1", 1: "GPU-b n1", 2: "GPU-a n1", 3: "GPU-c n2"}) == {"GPU-a": [0, 2]}
    with pytest.raises(LayoutError, match=r"^rank 2: ranks 0, 2 would all train on GPU GPU-a of n1: NCCL runs one "
                                          r"rank per GPU.*FXSHARD_SHARE_GPU=1 lets ranks share a GPU for a test"):
        refuse_shared({0: "GPU-a n1", 1: "GPU-b n1", 2: "GPU-a n1"}, rank=2, env={})
    refuse_shared({0: "GPU-a n1", 1: "GPU-a n1"}, rank=0, env={SHARE_GPU: "1"})  # asked for: allowed


def test_rank_device_on_a_faked_machine(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5d3c")  # srun names it by UUID
    monkeypatch.delenv(SHARE_GPU, raising=False)
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    assert dev.rank_device(7) == torch.device("cuda", 0) and chosen == [0]
    assert "NCCL_HOSTID" not in os.environ
    monkeypatch.setenv(SHARE_GPU, "1")
    dev.rank_device(7)
    assert os.environ["NCCL_HOSTID"] == "fxshard-rank7"  # NCCL takes each sharing rank for a host of its own


def test_posing_as_own_host_keeps_interfaces_already_chosen():
    env = {"NCCL_SOCKET_IFNAME": "eth0"}
    pose_as_own_host(3, env)
    assert env == {"NCCL_HOSTID": "fxshard-rank3", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"}


def _check(rank: int, world: int, uuids: list[str], share: bool):
    """A spawn target: this rank's GPU check with a faked UUID, through the real group's store."""
    if share:
        os.environ[SHARE_GPU] = "1"
    try:
        dev.check_own_gpu(rank, torch.device("cuda", 0), timeout_s=60, uuid_of=lambda device: uuids[rank])
    except LayoutError as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_ranks_compare_uuids_through_the_process_groups_store():
    assert spawn(_check, 3, ["GPU-a", "GPU-b", "GPU-c"], False) == [None] * 3
    refused = spawn(_check, 3, ["GPU-a", "GPU-b", "GPU-a"], False)
    assert all(m is not None and "ranks 0, 2 would all train on GPU GPU-a of " in m for m in refused), refused
    assert spawn(_check, 2, ["GPU-a", "GPU-a"], True) == [None, None]
