"""A small spawn harness for real multi-process gloo runs: the tests' and the benchmarks'
(no torch.testing._internal).

``spawn(fn, world, *args)`` starts ``world`` processes, each with an initialized gloo process
group and ``threads`` intra-op threads, calls ``fn(rank, world, *args)`` and returns the list of
results (pickled through files).  A worker exception raises here with that rank's traceback; a run
over ``timeout`` seconds is killed and fails, so a broken run never hangs its caller.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, folder: str, threads: int, fn, args) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    path = Path(folder) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report any failure to the parent with its traceback
        result = ("error", traceback.format_exc())
    path.write_bytes(pickle.dumps(result))


def spawn(fn, world: int, *args, timeout: float = 240.0, threads: int = 1) -> list:
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), folder, threads, fn, args), nprocs=world,
                                 join=False, start_method="spawn")
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s")
        results = []
        for rank in range(world):
            status, value = pickle.loads((Path(folder) / f"rank{rank}.pkl").read_bytes())
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


def measure_on_rank(rank: int, world: int, outs: dict[str, str], steps: int = 1) -> dict[str, dict]:
    """On this rank of an initialized process group: train each compiled folder of ``outs`` for ``steps``
    steps and return what the rank held, by name (a spawn target for tests and benchmarks)."""
    from fxshard.train.launch import train

    found = {}
    for name, out in outs.items():
        memory: dict = {}
        train(Path(out), steps, log=lambda *_: None, memory=memory)
        found[name] = memory
    return found
