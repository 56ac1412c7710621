"""Where a tp=2 step's time goes: torch.profiler around fxshard's eager steps and the hand-written one.

On a GPU a small model's step is as long as its host takes to queue the kernels, so the operators each stack
dispatches per step, the kernels it launches and its host time per operator tell why one step is longer than the
other; the NCCL kernels' time per step, how long they run (a kernel that waits for its peer runs on).
fxshard is profiled as it runs, without its backward overlap, and over the world group (its tp group is the
device mesh's, a communicator of its own).  Same model, batch, processes and AdamW as
:mod:`benchmarks.tp_step`::

    python -m benchmarks.profile_tp --device cuda --size small --out out/profile   # profile.txt there
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import BACKEND_OF, device_sync, spawn
from benchmarks.tp_step import (
    MODEL_FILE,
    TP,
    fxshard_contender,
    hand_written_contender,
    model_and_batch,
    model_size,
)

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")  # the host waits for the GPU


def _profiled(contender, steps: int, device: torch.device) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = device_sync(device)
    for _ in range(3):  # warm: the allocator's blocks, NCCL's communicators
        contender.step()
    sync()
    walls = []
    for _ in range(10):  # unprofiled
        dist.barrier()
        start = time.perf_counter()
        contender.step()
        sync()
        walls.append(time.perf_counter() - start)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            contender.step()
        sync()
    events = prof.key_averages()
    return {"aten ops per step": sum(e.count for e in events if e.key.startswith("aten::")) / steps,
            "kernel launches per step": sum(e.count for e in events if e.key in LAUNCHES) / steps,
            "host waits per step": sum(e.count for e in events if e.key in SYNCS) / steps,
            "host ms per step": sum(e.self_cpu_time_total for e in events) / 1e3 / steps,
            "host ms per step waiting for the GPU": sum(e.self_cpu_time_total for e in events if e.key in SYNCS)
            / 1e3 / steps,
            # the kernels alone: the profiler's nccl:* annotations carry the same GPU time again
            "NCCL kernel ms per step": sum(e.self_device_time_total for e in events
                                           if e.device_type == DeviceType.CUDA and e.key.startswith("nccl")) / 1e3 / steps,
            "step ms, median of 10 unprofiled": statistics.median(walls) * 1e3,
            "table": events.table(sort_by="self_cpu_time_total", row_limit=30)}


def _worker(rank: int, world: int, outs: dict[str, str], size: str, steps: int) -> dict:
    full, inputs, device = model_and_batch(size)
    world_group = {"tp": dist.group.WORLD, "dp": None, "pp": None}  # what the hand-written code talks over
    makers = {"fxshard": lambda: fxshard_contender(Path(outs["overlap"]), inputs),
              "fxshard, no overlap": lambda: fxshard_contender(Path(outs["no overlap"]), inputs),
              "fxshard, world group": lambda: fxshard_contender(Path(outs["overlap"]), inputs, groups=world_group),
              "hand-written": lambda: hand_written_contender(full, inputs)}
    return {name: _profiled(make(), steps, device) for name, make in makers.items()}


def main(argv: list[str] | None = None) -> str:
    from fxshard.compiler import compile as compile_model
    from fxshard.ir.context import Layout

    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_tp", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("out/profile"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work, model_size(args.size):
        outs = {name: str(Path(work) / name.replace(" ", "-")) for name in ("overlap", "no overlap")}
        for name, out in outs.items():
            compile_model(MODEL_FILE, Layout(tp=TP, overlap=name == "overlap"), out=Path(out))
        per_rank = spawn(_worker, TP, outs, args.size, args.steps, backend=BACKEND_OF[args.device])
    lines = []
    for name, found in per_rank[0].items():
        lines += [f"== {name} (rank 0, {args.size}, {args.device}): " + ", ".join(
            f"{k} {v:.1f}" for k, v in found.items() if k != "table"), found["table"]]
    text = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
