"""Where a tp=2 step's time goes: torch.profiler around fxshard's eager steps and the hand-written one.

On a GPU a small model's step is as long as its host takes to queue the kernels, so the operators each stack
dispatches per step, the kernels it launches and its host time per operator tell why one step is longer than the
other; the NCCL kernels' time per step, how long they run (a kernel that waits for its peer runs on).
fxshard is profiled as it runs, without its backward overlap, and over the world group (its tp group is the
device mesh's, a communicator of its own).  Same model, batch, processes and AdamW as
:mod:`benchmarks.tp_step`.

Which part of a gap is fxshard's and which the shared GPU's: with two ranks on one GPU, each step's collectives
cross host memory through NCCL's socket transport, and the two processes' kernels share the GPU (under MPS) or
take turns.  So each contender also runs **alone**: rank 0's program in one process, on a fake process group
whose collectives do nothing (torch's ``FakeProcessGroup``: no NCCL, no second process, the same kernels and
Python otherwise).  What still differs there is fxshard's own (its kernels and its host time per step); what
differs only with the ranks on the shared GPU comes with the communication.  The kernels each eager step
launches are counted by name, and the names fxshard launches more often than the hand-written code are listed::

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
    kernels = {e.key: e.count / steps for e in events if e.device_type == DeviceType.CUDA}
    return {"aten ops per step": sum(e.count for e in events if e.key.startswith("aten::")) / steps,
            "kernel launches per step": sum(e.count for e in events if e.key in LAUNCHES) / steps,
            "host waits per step": sum(e.count for e in events if e.key in SYNCS) / steps,
            "host ms per step": sum(e.self_cpu_time_total for e in events) / 1e3 / steps,
            "host ms per step waiting for the GPU": sum(e.self_cpu_time_total for e in events if e.key in SYNCS)
            / 1e3 / steps,
            # the kernels alone: the profiler's nccl:* annotations carry the same GPU time again
            "NCCL kernel ms per step": sum(e.self_device_time_total for e in events
                                           if e.device_type == DeviceType.CUDA
                                           and e.key.startswith("nccl")) / 1e3 / steps,
            "GPU ms per step, other kernels": sum(e.self_device_time_total for e in events
                                                   if e.device_type == DeviceType.CUDA and not e.key.startswith("nccl"))
            / 1e3 / steps,
            "step ms, median of 10 unprofiled": statistics.median(walls) * 1e3,
            "kernels": {k: v for k, v in kernels.items() if not k.startswith("nccl")},
            "table": events.table(sort_by="self_cpu_time_total", row_limit=30)}


def _worker(rank: int, world: int, outs: dict[str, str], size: str, steps: int) -> dict:
    full, inputs, device = model_and_batch(size)
    world_group = {"tp": dist.group.WORLD, "dp": None, "pp": None}  # what the hand-written code talks over
    makers = {"fxshard": lambda: fxshard_contender(Path(outs["overlap"]), inputs),
              "fxshard, no overlap": lambda: fxshard_contender(Path(outs["no overlap"]), inputs),
              "fxshard, world group": lambda: fxshard_contender(Path(outs["overlap"]), inputs, groups=world_group),
              "hand-written": lambda: hand_written_contender(full, inputs)}
    return {name: _profiled(make(), steps, device) for name, make in makers.items()}


def _alone(outs: dict[str, str], size: str, steps: int, device: str) -> dict:
    """Rank 0 of each contender in this process, its collectives on torch's fake process group (they do nothing)."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    except ImportError as e:
        return {"error": f"no fake process group in this torch: {e}"}
    if device == "cuda":
        torch.cuda.set_device(0)
    else:  # a fake all-gather leaves its output as allocated: denormal garbage would slow the CPU's arithmetic 100x
        torch.set_flush_denormal(True)
    dist.init_process_group("fake", rank=0, world_size=TP, store=dist.HashStore())
    try:
        found = _worker(0, TP, outs, size, steps)
    finally:
        dist.destroy_process_group()
    found.pop("fxshard, world group")  # the same program as fxshard's when no group communicates
    return found


def _kernel_difference(a: dict, b: dict, top: int = 12) -> list[str]:
    """The kernels ``a`` launches more often per step than ``b`` (by name), most first."""
    names = set(a["kernels"]) | set(b["kernels"])
    more = sorted(((a["kernels"].get(k, 0) - b["kernels"].get(k, 0), k) for k in names), reverse=True)
    return [f"  {d:+5.1f}  {k[:110]}" for d, k in more[:top] if d > 0]


def verdict(shared: dict, alone: dict) -> str:
    """Which part of fxshard's eager gap to the hand-written step is fxshard's and which the shared GPU's."""
    key = "step ms, median of 10 unprofiled"
    f, h = shared["fxshard"], shared["hand-written"]
    lines = ["== verdict: fxshard's eager step against the hand-written one, two ranks sharing the GPU and alone",
             f"shared GPU (NCCL, 2 processes): fxshard {f[key]:.2f} ms, hand-written {h[key]:.2f} ms: "
             f"{f[key] / h[key]:.3f}x, {f[key] - h[key]:+.2f} ms"]
    if "error" in alone:
        return "\n".join(lines + [f"alone: not measured ({alone['error']})"])
    fa, ha = alone["fxshard"], alone["hand-written"]
    own = fa[key] - ha[key]
    lines += [f"alone (rank 0 only, collectives do nothing): fxshard {fa[key]:.2f} ms, hand-written {ha[key]:.2f} ms: "
              f"{fa[key] / ha[key]:.3f}x, {own:+.2f} ms",
              f"kernel launches per step alone: fxshard {fa['kernel launches per step']:.0f}, hand-written "
              f"{ha['kernel launches per step']:.0f}; GPU ms per step in other kernels than NCCL's: fxshard "
              f"{fa['GPU ms per step, other kernels']:.2f}, hand-written {ha['GPU ms per step, other kernels']:.2f}; "
              f"host ms per step: fxshard {fa['host ms per step']:.2f}, hand-written {ha['host ms per step']:.2f}",
              f"so of the {f[key] - h[key]:+.2f} ms, {own:+.2f} ms is fxshard's own program (kernels and host work "
              f"with no communication) and {f[key] - h[key] - own:+.2f} ms comes with the communication of two ranks "
              "on the shared GPU",
              "kernels fxshard launches more often per step than the hand-written code (alone):"]
    return "\n".join(lines + (_kernel_difference(fa, ha) or ["  none"]))


def main(argv: list[str] | None = None) -> str:
    from fxshard.driver import compile as compile_model
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
        alone = _alone(outs, args.size, args.steps, args.device)
    lines = [verdict(per_rank[0], alone)]
    for mode, results in (("two ranks", per_rank[0]), ("alone", alone)):
        for name, found in results.items():
            if name == "error":
                continue
            lines += [f"== {name} ({mode}, rank 0, {args.size}, {args.device}): " + ", ".join(
                f"{k} {v:.1f}" for k, v in found.items() if k not in ("table", "kernels")), found["table"]]
    text = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text(text + "\n")
    print(text + "\n\n" + lines[0])  # the verdict again, last: what a log's tail shows
    return text


if __name__ == "__main__":
    main()
