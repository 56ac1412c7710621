"""This process as one rank: its device and the default process group (started by torchrun, or by ``fxshard run``'s
local launcher), with start-up failures named by the ranks that never joined::

    device = start_rank(timeout=300.0)   # RANK / WORLD_SIZE / MASTER_ADDR from the environment
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist


def start_rank(timeout: float) -> torch.device:
    """This rank's device (under CUDA its GPU, :func:`fxshard.train.device.rank_device`: the one it sees, else
    LOCAL_RANK's; else the CPU with OMP_NUM_THREADS threads) and, unless already done, the default process group
    (NCCL or gloo), within ``timeout`` seconds; two ranks on one GPU are refused before NCCL's first communicator."""
    cuda = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    if cuda:
        from fxshard.train.device import rank_device

        device = rank_device(rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
        except Exception as e:
            raise start_up_error(e, rank, int(os.environ["WORLD_SIZE"]), timeout) from e
    if cuda:
        from fxshard.train.device import check_own_gpu

        check_own_gpu(rank, device, timeout_s=timeout)  # two ranks on one GPU, by UUID, before NCCL's first
    return device


def start_up_error(e: Exception, rank: int, world: int, timeout_s: float) -> Exception:
    """A process group that did not form: name the ranks that never joined (from the store keys torch waited
    for) instead of torch's ``DistStoreError: wait timeout ... keys: /default_pg/0//cpu//0/1``."""
    from fxshard.runtime.guard import CollectiveError

    text = str(e)
    missing = sorted({int(m) for m in re.findall(r"/(\d+)(?=[\s,\]'\"]|$)", text.split("keys", 1)[-1])}
                     - {rank}) if "keys" in text else []
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if missing:
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {world}"
    elif joined:
        who = f"{int(joined[2]) - int(joined[1])} of {world} ranks"
    elif rank != 0 and "connect" in text:  # the store lives in rank 0 (or the launcher): nothing to join
        host = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        who = f"rank 0, which hosts the store at {host} (MASTER_ADDR:MASTER_PORT),"
    else:
        who = f"some of the {world} ranks"
    return CollectiveError(
        f"rank {rank}: start-up: {who} did not join the process group within --timeout {timeout_s:g} s "
        f"(not started, stopped, or died before connecting); {type(e).__name__}: {text.strip().splitlines()[0][:200]}")
