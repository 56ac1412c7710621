"""Which GPU a rank trains on, and the refusal of two ranks on one GPU.

A rank takes its GPU the way torchrun's and SLURM's users expect:

- the one GPU it sees, when it sees one: SLURM's ``srun --gpus-per-task=1`` (or ``CUDA_VISIBLE_DEVICES`` set per
  process) shows each process its own GPU as device 0, whatever its ``LOCAL_RANK``;
- else GPU ``LOCAL_RANK`` (torchrun sets it; under srun, ``LOCAL_RANK=$SLURM_LOCALID``);
- else, with no ``LOCAL_RANK``, GPU ``RANK`` (one machine, started by hand).

Two ranks on one GPU are found by comparing the GPUs' UUIDs over the process group's store, right after the
group forms and before NCCL builds a communicator (NCCL would answer "Duplicate GPU detected"), not by counting
processes against GPUs: counts cannot see two machines' worth of ``CUDA_VISIBLE_DEVICES`` naming one GPU.  They
are refused, unless ``FXSHARD_SHARE_GPU=1`` asks for it (a test of many ranks on one GPU, as
``scripts/gpu_check.sh matrix`` runs): then each rank poses as a host of its own (``NCCL_HOSTID``) and NCCL joins
them through its socket transport over loopback.  Its collectives then cross host memory, not NVLink: such a run
tests that the program is right on NCCL, not how fast it would be on GPUs of its own.

Everything that reads the environment or the GPUs takes them as arguments, so the choice is tested on machines
without a GPU (``tests/train/test_device.py``)::

    device = rank_device(rank)               # before init_process_group
    dist.init_process_group("nccl")
    check_own_gpu(rank, device)              # every rank, before the first collective
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch

from fxshard.errors import LayoutError

SHARE_GPU = "FXSHARD_SHARE_GPU"
_KEY = "fxshard/gpu/"  # the store keys of each rank's GPU: fxshard/gpu/<rank>


def sharing_allowed(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``FXSHARD_SHARE_GPU=1`` lets several ranks train on one GPU (a test, never a real run)."""
    return env.get(SHARE_GPU, "") == "1"


def choose_gpu(rank: int, visible: int, env: Mapping[str, str] = os.environ) -> int:
    """This rank's GPU, an index among the ``visible`` GPUs its process sees (the module docstring says how).

    >>> choose_gpu(5, 1, {"LOCAL_RANK": "1"})      # srun --gpus-per-task=1: its own GPU, device 0
    0
    >>> choose_gpu(5, 8, {"LOCAL_RANK": "1"})      # torchrun on a machine of 8 GPUs
    1
    """
    if visible < 1:
        raise LayoutError(f"rank {rank}: NCCL needs a GPU and this process sees none "
                          f"({_shown(env)}); train on the CPU with gloo instead "
                          "(CUDA_VISIBLE_DEVICES= fxshard run ...)")
    if visible == 1:
        return 0
    local = env.get("LOCAL_RANK")
    index = int(local) if local is not None else rank
    if index < visible:
        return index
    if sharing_allowed(env):
        return index % visible
    how = (f"its LOCAL_RANK {local} asks for GPU {local}" if local is not None else
           f"LOCAL_RANK is not set, so its rank {rank} is taken as its GPU index (launch with torchrun, which sets "
           "LOCAL_RANK, or under srun export LOCAL_RANK=$SLURM_LOCALID)")
    raise LayoutError(
        f"rank {rank}: {how}, but this process sees {visible} GPUs ({_shown(env)}): NCCL runs one rank per GPU.  "
        f"Start at most {visible} processes per machine (torchrun --nproc-per-node {visible}), give each process "
        "its own GPU (srun --gpus-per-task=1), or train on the CPU with gloo (CUDA_VISIBLE_DEVICES= fxshard run ...)")


def _shown(env: Mapping[str, str]) -> str:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is not set" if visible is None else f"CUDA_VISIBLE_DEVICES={visible}"


def pose_as_own_host(rank: int, env: dict = os.environ) -> None:
    """Let this rank share a GPU with others under NCCL: its own ``NCCL_HOSTID`` (NCCL then takes the ranks for
    separate hosts, and refuses no duplicate GPU), the loopback interface for its sockets, no InfiniBand.  Values
    already set are kept."""
    env["NCCL_HOSTID"] = f"fxshard-rank{rank}"
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_IB_DISABLE", "1")


def rank_device(rank: int) -> torch.device:
    """This rank's GPU, made current (:func:`choose_gpu`); under ``FXSHARD_SHARE_GPU=1`` it also poses as a host of
    its own (:func:`pose_as_own_host`).  Call before ``init_process_group``."""
    index = choose_gpu(rank, torch.cuda.device_count())
    if sharing_allowed():
        pose_as_own_host(rank)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID (the same in every process that sees it, whatever index it has there)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def shared_gpus(gpus: Mapping[int, str]) -> dict[str, list[int]]:
    """The GPUs (by UUID) that more than one rank of ``gpus`` (rank -> "UUID host") trains on, with their ranks.

    >>> shared_gpus({0: "GPU-a node1", 1: "GPU-a node1", 2: "GPU-b node2"})
    {'GPU-a': [0, 1]}
    """
    ranks: dict[str, list[int]] = {}
    for rank, seen in sorted(gpus.items()):
        ranks.setdefault(seen.split()[0], []).append(rank)
    return {uuid: on for uuid, on in ranks.items() if len(on) > 1}


def exchange(store, rank: int, world: int, value: str, timeout_s: float = 300.0) -> dict[int, str]:
    """Every rank's ``value`` (rank -> value) through the process group's store, this rank's included."""
    store.set(f"{_KEY}{rank}", value)
    keys = [f"{_KEY}{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return {r: store.get(k).decode() for r, k in enumerate(keys)}


def refuse_shared(gpus: Mapping[int, str], rank: int, env: Mapping[str, str] = os.environ) -> None:
    """Refuse two ranks of ``gpus`` (rank -> "UUID host") on one GPU, unless ``FXSHARD_SHARE_GPU=1``."""
    shared = shared_gpus(gpus)
    if not shared or sharing_allowed(env):
        return
    uuid, ranks = next(iter(shared.items()))
    host = (gpus[ranks[0]].split(maxsplit=1) + ["?"])[1]
    more = f" (and {len(shared) - 1} more GPU{'s' if len(shared) > 2 else ''} shared)" if len(shared) > 1 else ""
    raise LayoutError(
        f"rank {rank}: ranks {', '.join(map(str, ranks))} would all train on GPU {uuid} of {host}{more}: NCCL runs "
        "one rank per GPU.  Give each rank its own GPU (torchrun --nproc-per-node at most the machine's GPUs; "
        "srun --gpus-per-task=1; a CUDA_VISIBLE_DEVICES of its own per process), or train on the CPU with gloo "
        f"(CUDA_VISIBLE_DEVICES= fxshard run ...).  {SHARE_GPU}=1 lets ranks share a GPU for a test of correctness")


def check_own_gpu(rank: int, device: torch.device, timeout_s: float = 300.0,
                  uuid_of: Callable[[torch.device], str] = gpu_uuid) -> None:
    """After ``init_process_group``, before the first collective: refuse two ranks on one GPU, found by UUID
    (:func:`refuse_shared`), exchanged through the default process group's store (torchrun's, or the launcher's)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    gpus = exchange(store, rank, dist.get_world_size(), f"{uuid_of(device)} {socket.gethostname()}", timeout_s)
    refuse_shared(gpus, rank)
