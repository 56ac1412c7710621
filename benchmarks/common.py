"""What every benchmark shares: spawning gloo processes, interleaved timing, medians, result files.

Fair comparisons need the contenders to see the same machine at the same moment.  So one set of
processes holds every contender, and :func:`interleave` runs one step of each in turn
(A B C, B C A, C A B, ...: the order rotates so no contender holds a favoured position) with a
barrier before each step; a burst of load from elsewhere slows all of them alike.  A step's time is
the slowest rank's time for it (collectives keep the ranks in lock step, so that is the step's wall
time).  Medians, not means, summarize the steps::

    times = interleave({"a": step_a, "b": step_b}, rounds=20, warmup=2)   # in every rank
    summary = summarize(combine_ranks(per_rank_times))                    # in the parent
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from fxshard.testing import spawn as _spawn

THREADS_PER_PROCESS = 1
BACKEND_OF = {"cpu": "gloo", "cuda": "nccl"}  # the process group backend of each device the benchmarks run on


# ---------------------------------------------------------------- processes


def spawn(fn: Callable, world: int, *args, timeout: float = 600.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes on a gloo group (or NCCL's, each rank on
    a GPU: :mod:`fxshard.testing`); their results by rank.

    Each process uses :data:`THREADS_PER_PROCESS` intra-op threads, so every contender gets the same
    compute.  A failing rank raises here with its traceback; a run over ``timeout`` is killed."""
    return _spawn(fn, world, *args, timeout=timeout, threads=THREADS_PER_PROCESS, backend=backend)


# ---------------------------------------------------------------- timing


def interleave(steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
               sync: Callable[[], object] = lambda: None) -> dict[str, list[tuple]]:
    """Run ``rounds`` rounds of one call of each step, after ``warmup`` untimed rounds; per call, the
    (wall, process CPU) seconds it took on this rank.

    The order rotates by one each round (A B C, B C A, C A B, ...): every contender takes every
    position equally often, so none always runs right after the same neighbour (whose freed memory
    and evicted caches it would inherit) or always first after the warm-up.  Called on every rank
    with the same steps; a barrier before each call lines the ranks up so the time measured is the
    step's own, not the wait for a slower peer's previous step.  Process CPU time (all threads,
    gloo's included) does not advance while other programs hold the cores, so it shows the work a
    step does even on a crowded machine.  ``sync`` waits for the device before the clock is read at a step's
    end (:func:`device_sync`: a GPU runs its kernels after the call that queues them returns), so every step
    also starts on an idle device."""
    times: dict[str, list[tuple]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(warmup + rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            steps[name]()
            sync()
            if r >= warmup:
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def device_sync(device: torch.device) -> Callable[[], object]:
    """What waits for ``device`` to finish the work queued on it: ``torch.cuda.synchronize`` on a GPU, nothing on
    the CPU (its ops return done)."""
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def combine_ranks(per_rank: list[dict[str, list[tuple]]]) -> dict[str, dict[str, list[float]]]:
    """Per contender and step: the wall time of the slowest rank and the CPU time of all ranks together."""
    out = {}
    for name in per_rank[0]:
        steps = list(zip(*(r[name] for r in per_rank), strict=True))
        out[name] = {"wall": [max(w for w, _ in s) for s in steps], "cpu": [sum(c for _, c in s) for s in steps]}
    return out


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """Per contender in milliseconds: the median wall time with its quartiles, the median CPU time."""
    out = {}
    for name, t in times.items():
        ms = sorted(x * 1e3 for x in t["wall"])
        q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
        out[name] = {"median_ms": round(statistics.median(ms), 3), "p25_ms": round(q[0], 3),
                     "p75_ms": round(q[2], 3), "cpu_median_ms": round(statistics.median(t["cpu"]) * 1e3, 3),
                     "steps": len(ms)}
    return out


def mps_running() -> bool:
    """Whether a CUDA MPS control daemon listens where this process's CUDA clients would look for it: processes
    sharing a GPU then run their kernels side by side instead of in turns."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return (pipe / "control").exists()


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def paired_ratio(times: dict[str, dict[str, list[float]]], a: str, b: str) -> dict:
    """The median, over rounds, of ``a``'s step time divided by ``b``'s in the same round, with quartiles.

    Interleaved rounds run ``a`` and ``b`` moments apart, so a burst of load from elsewhere lands on both
    and cancels in their quotient; the median of these quotients is steadier than a quotient of medians."""
    q = sorted(x / y for x, y in zip(times[a]["wall"], times[b]["wall"], strict=True) if y)
    quart = statistics.quantiles(q, n=4, method="inclusive") if len(q) > 1 else [q[0]] * 3
    return {"median": round(statistics.median(q), 3), "p25": round(quart[0], 3), "p75": round(quart[2], 3)}


# ---------------------------------------------------------------- results


VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
                "amx_tile", "asimd", "sve", "sve2")  # the vector extensions torch's CPU kernels choose paths by


def cpu_model(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and the vector extensions it has (of :data:`VECTOR_FLAGS`), from /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "cpu_vector": [f for f in VECTOR_FLAGS if f in flags]}


def cpu_line(env: dict) -> str:
    """"AMD EPYC (avx, avx2, fma; no AVX-512)": how a table names the CPU it ran on."""
    if "cpu" not in env:
        return "a CPU whose model this run did not record (results from before the benchmarks recorded it)"
    vector = env.get("cpu_vector", [])
    no512 = "" if any(f.startswith("avx512") for f in vector) or not vector else "; no AVX-512"
    return f"{env.get('cpu', 'CPU')} ({', '.join(vector) or 'vector extensions unknown'}{no512})"


def environment(backend: str = "gloo") -> dict:
    """The machine and settings a result was measured under (on a GPU: its name, CUDA's and NCCL's versions)."""
    gpu = {}
    if backend == "nccl":
        nccl = torch.cuda.nccl.version()
        gpu = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda,
               "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}
    return gpu | {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **cpu_model(),
        "backend": backend,
        "threads_per_process": THREADS_PER_PROCESS,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(results: dict, markdown: str, folder: Path, name: str = "latest") -> tuple[Path, Path]:
    """Write ``NAME.json`` and ``NAME.md`` into ``folder``; return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / f"{name}.json", folder / f"{name}.md"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path
