"""``fxshard calibrate``: measure the machine it runs on and write a hardware profile (:mod:`fxshard.cost.hardware`).

Every rank of the group (``fxshard calibrate --procs N`` starts N local processes; under ``torchrun`` the ranks are
torchrun's, on one node or many) measures at the same time, so a shared device or CPU is measured as the training
run will share it:

- matmul FLOP/s per dtype (a square product large enough to reach the kernel's rate; on a CPU a run of them, so the
  rate is the one sustained while every rank computes, as in training), and attention's
  (``scaled_dot_product_attention``) as a share of it: the profile's ``peak_flops`` and ``efficiency.attention``;
- memory bandwidth (a large copy: bytes read and written per second) and the time of a small op under autograd,
  its forward and its backward (``kernel_overhead``, a third of the two, as the time model charges an op once
  forward and twice backward: eager dispatch, autograd's graph, a floor for small ops);
- collectives per group size, under load: all-reduce, all-gather, reduce-scatter over groups of consecutive ranks
  within a node (and, across nodes, of ranks one node apart), several sizes each.  Every rank is in one group of
  the size and all groups measure at once, each rank computing between its collectives as a training step does: a
  collective's time is what a run of matmuls with one after each takes over the same run without.  On a CPU whose
  ranks outnumber its cores a collective waits for its peers to be scheduled again: over 4 gloo ranks on 2 cores a
  64 KiB all-reduce of 4 took 1.5 ms alone and 4.4 to 5.2 ms beside computing ranks (tp, ZeRO 3 issue tens a step).
  Each link's bus bandwidth and latency are the least-squares fit of ``time = steps x latency + wire bytes /
  bandwidth`` (the ring formulas the time model uses), over all group sizes, and within a node once per group size
  (``groups``) and once per collective and group size (``collectives``: on gloo a large reduce-scatter takes longer
  than an all-reduce of the same buffer, the ring formula's double);
- overlap: an all-reduce in flight during a run of matmuls, against the two apart; the share of the shorter one
  that was hidden is the profile's ``overlap`` (on a CPU the collective's copies and sums share the cores);
- selective recompute's cost per op: a chain of small ops through ``rt.recompute(keep="matmuls")`` (torch's
  selective checkpoint, whose policy runs in a Python dispatch mode for every op, forward and recompute) against
  the same chain under plain autograd, less the op's own run again (``selective_overhead``);
- with ``--model FILE``: the model's own forward and backward on every rank at once, at its example batch's rows
  over the ranks (the op mix a step runs: small products, norms, elementwise ops), against the time model's
  roofline for the same step on the profile measured so far; their ratio is ``compute_scale``, which the time model
  multiplies into every compute term.

The measured points stay in the profile (``measured``), next to the fitted fields::

    fxshard calibrate --procs 4 --out cpu.json          # this machine, 4 processes (as fxshard run at world size 4)
    fxshard calibrate --procs 4 --out cpu.json --model benchmarks/models/auto_llama.py   # and that model's op mix
    torchrun --nnodes 2 --nproc-per-node 8 -m fxshard.cli.app calibrate --out h100-measured.json
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from fxshard.cost.hardware import ring_terms
from fxshard.errors import OptionError

OPS = ("all_reduce", "all_gather", "reduce_scatter")
PROFILE = "a hardware profile"  # what fxshard.files records the profile as
PER_CORE = 4  # measuring processes per core at most: beyond, a measurement times the scheduler
PER_PROCESS = 512 << 20  # memory one measuring process takes (torch, its buffers), for the bound on --procs


def calibrate(out: Path, procs: int = 1, quick: bool = False, model: Path | None = None) -> dict:
    """Measure this machine with ``procs`` local processes (gloo on CPUs, nccl on GPUs) and write the profile to
    ``out``; under ``torchrun`` (``RANK`` set) the ranks are torchrun's and ``procs`` is not used; ``model``: a
    model file whose forward and backward set the profile's ``compute_scale``."""
    out = Path(out)
    if model is not None and not Path(model).is_file():
        raise OptionError(f"--model {model}: expected a model file (make_model, make_inputs); found no such file")
    if out.exists() and out.is_dir():
        raise OptionError(f"--out {out}: expected a file to write the profile to; found a folder")
    if not out.parent.is_dir():
        raise OptionError(f"--out {out}: its folder {out.parent} does not exist; create it first")
    from fxshard.files import check_replaceable

    check_replaceable(out, PROFILE)  # a link, or a file fxshard did not write: refused before minutes of measuring
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        calibrate_rank(out, quick, model)
        return json.loads(out.read_text()) if out.exists() else {}
    if procs < 2:
        raise OptionError(f"--procs {procs}: expected at least 2 processes (collectives need a group); "
                          "use --procs 2 or more, or start it under torchrun")
    check_procs(procs)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(procs, port, str(out), quick, model and str(model)), nprocs=procs,
                       start_method="spawn")
    return json.loads(out.read_text())


def check_procs(procs: int) -> None:
    """Refuse more local processes than this machine holds: one per GPU (NCCL), else at most :data:`PER_CORE` per
    core and what its available memory holds at :data:`PER_PROCESS` each."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if procs > gpus:
            raise OptionError(f"--procs {procs}: this machine shows {gpus} GPU{'s' * (gpus != 1)}, and NCCL runs one "
                              f"process per GPU; use --procs {gpus} or fewer, or calibrate across machines under "
                              "torchrun")
        return
    cores = os.cpu_count() or 1
    free = _available_memory()
    limit = min(PER_CORE * cores, max(2, free // PER_PROCESS) if free else PER_CORE * cores)
    if procs > limit:
        raise OptionError(f"--procs {procs}: this machine holds at most {limit} measuring processes ({cores} cores, "
                          f"at most {PER_CORE} processes per core" + (f"; {free / 2**30:.1f} GiB of memory "
                                                                        f"available, about {PER_PROCESS >> 20} MiB "
                                                                        "each" if free else "")
                          + f"); use --procs {limit} or fewer (as many as the run will start), or calibrate across "
                          "machines under torchrun")


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _spawned(rank: int, world: int, port: int, out: str, quick: bool, model: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # a training rank's own setting: each process one thread, as fxshard run starts them
    try:
        calibrate_rank(Path(out), quick, model and Path(model))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def calibrate_rank(out: Path, quick: bool = False, model: Path | None = None) -> dict | None:
    """Measure as one rank of the job (initializing the process group from torchrun's environment if needed);
    rank 0 writes ``out`` and returns the profile, the others None."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = min(int(os.environ.get("LOCAL_WORLD_SIZE", world)), world)
    if world % local:
        raise OptionError(f"calibrate: expected WORLD_SIZE ({world}) to be a multiple of LOCAL_WORLD_SIZE ({local}), "
                          "the ranks of each node; found otherwise: start it with torchrun --nproc-per-node, or "
                          "fxshard calibrate --procs N on one machine")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtypes = ["bf16", "fp16", "fp32"] if cuda else ["fp32", "bf16"]
    peaks = {d: _agreed(_matmul_rate(d, device, quick)) for d in dtypes}
    contention = max(1.0, _agreed(_matmul_alone(device, quick)) / peaks["fp32"])
    attention = _agreed(_attention_rate(device, quick)) / peaks["fp32" if not cuda else "bf16"]
    bandwidth = _agreed(_copy_rate(device, quick))
    overhead = _agreed(_overhead(device))
    selective = max(0.0, _agreed(_selective_overhead(device)) - overhead)  # less the op's own run again
    step = _agreed(_model_step(model, world, device, quick)) if model is not None else None
    overlap = _agreed(_overlap(device, quick))
    nodes = world // local
    links = {"intra_node": _link(_intra_groups, local, world, device, quick),
             "inter_node": _link(_inter_groups, nodes, world, device, quick) if nodes > 1 else None}
    if rank != 0:
        return None
    intra = links["intra_node"]
    profile = {
        "name": f"measured by fxshard calibrate on {_machine(device)}, {world} ranks ({local} per node)",
        "source": f"fxshard calibrate, {datetime.now(timezone.utc).isoformat(timespec='seconds')}, load average "
                  f"{_load()}",
        "device": device.type,
        "peak_flops": peaks, "memory_bandwidth": bandwidth, "memory": _memory(device, local),
        "devices_per_node": local,
        "intra_node": {"bandwidth": intra["bandwidth"], "latency": intra["latency"]} if intra else
                      {"bandwidth": bandwidth, "latency": 1e-6},
        "inter_node": ({"bandwidth": links["inter_node"]["bandwidth"], "latency": links["inter_node"]["latency"]}
                       if links["inter_node"] else (
                           {"bandwidth": intra["bandwidth"], "latency": intra["latency"]} if intra else
                           {"bandwidth": bandwidth, "latency": 1e-6})),
        "efficiency": {"matmul": 1.0, "attention": round(min(1.0, attention), 3), "memory": 1.0},
        "kernel_overhead": overhead,
        "groups": {str(g): fit for g, fit in intra["groups"].items()} if intra else {},
        "collectives": {op: {str(g): fit for g, fit in by_group.items()}
                        for op, by_group in intra["collectives"].items()} if intra else {},
        "overlap": round(overlap, 3),
        "contention": round(contention, 3),
        "selective_overhead": selective,
        "default_dtype": "bf16" if cuda else "fp32",
        "measured": {k: v for k, v in links.items() if v},
    }
    from fxshard.files import write_text

    write_text(out, json.dumps(profile, indent=2) + "\n", PROFILE)
    if model is not None:
        profile = _with_compute_scale(out, profile, model, world, step)
    return profile


def _agreed(value: float) -> float:
    """The median over the ranks of each rank's measurement (every rank returns it)."""
    world = dist.get_world_size()
    values = [None] * world
    dist.all_gather_object(values, value)
    return float(statistics.median(values))


def _timed(fn, device, repeats: int, group=None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up), the ranks of ``group`` (default: all)
    starting together."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _matmul_rate(dtype: str, device, quick: bool, group=None) -> float:
    n = (4096 if not quick else 2048) if device.type == "cuda" else (512 if quick else 1024)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    w = torch.randn(n, n, device=device, dtype=torch_dtype)
    run = 1 if device.type == "cuda" else 8  # a CPU's rate over ~0.1 s, all ranks at once: what training sustains

    def products():
        for _ in range(run):
            a @ w

    return run * 2 * n**3 / _timed(products, device, 3 if quick else 7, group)


def _matmul_alone(device, quick: bool) -> float:
    """The fp32 rate of :func:`_matmul_rate` with this rank computing alone, the others waiting in turn."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank makes each
    rate = 0.0
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if dist.get_rank() == turn:
            rate = _matmul_rate("fp32", device, quick, group=groups[turn])
        dist.barrier()
    return rate


def _attention_rate(device, quick: bool) -> float:
    heads, seq, dim = 8, (256 if quick else 512) if device.type == "cpu" else 4096, 64
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(1, heads, seq, dim, device=device, dtype=dtype) for _ in range(3))
    t = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), device, 3 if quick else 7)
    return 4 * heads * seq * seq * dim / t


def _copy_rate(device, quick: bool) -> float:
    n = (2**26 if device.type == "cpu" else 2**28) // (4 if quick else 1)
    src = torch.ones(n // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * n / _timed(lambda: dst.copy_(src), device, 5)


def _overhead(device) -> float:
    """A third of a small op's forward and backward under autograd (the time model charges each op once forward,
    twice backward)."""
    x = torch.zeros(8, device=device, requires_grad=True)

    def many():
        y = x
        for _ in range(200):
            y = y * 1.5
        y.sum().backward()

    return _timed(many, device, 5) / 200 / 3


def _chain(y, n: int = 200):
    for _ in range(n):
        y = y * 1.5
    return y


def _selective_overhead(device) -> float:
    """Seconds per op that a chain of small ops takes more through selective recompute (``rt.recompute``,
    ``keep="matmuls"``) than under plain autograd, forward and backward: the policy's dispatch in forward and in the
    recompute, and the op run again (the caller takes the latter, one ``kernel_overhead``, off)."""
    from fxshard.runtime.recompute import recompute

    x = torch.zeros(8, device=device, requires_grad=True)
    block = _Chain()
    plain = _timed(lambda: block(x).sum().backward(), device, 5)
    selective = _timed(lambda: recompute(block, x, keep="matmuls").sum().backward(), device, 5)
    return max(0.0, selective - plain) / 200


class _Chain(torch.nn.Module):
    def forward(self, y):
        return _chain(y)


def _model_step(model: Path, world: int, device, quick: bool) -> float:
    """Median seconds of the model's forward and backward (its loss, as the capture takes it) at its example batch's
    rows over the ranks, every rank at once."""
    from fxshard.capture.modelfile import load_model_file

    mf = load_model_file(model)
    net, inputs = mf.build(0)
    net.to(device).train()
    inputs = _rows(inputs, max(1, _batch(inputs) // world), device)

    def step():
        out = net(*inputs) if isinstance(inputs, tuple) else net(**inputs)
        if mf.loss_fn is not None:
            loss = mf.loss_fn(out, inputs)
        else:
            loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        net.zero_grad(set_to_none=True)

    return _timed(step, device, 3 if quick else 5)


def _batch(inputs) -> int:
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return next((v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), 1)


def _rows(inputs, rows: int, device):
    """The first ``rows`` of every batched tensor of the example (what one dp rank of ``batch // rows`` holds)."""
    batch = _batch(inputs)

    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            return v[:rows].to(device)
        return v
    return {k: cut(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(cut(v) for v in inputs)


def _with_compute_scale(out: Path, profile: dict, model: Path, world: int, measured: float) -> dict:
    """The profile with ``compute_scale``: the model's measured step over the time model's roofline for it (one rank,
    no communication, the profile's rates as measured), and what both were (``measured.model_step``)."""
    from fxshard.cost.hardware import load_hardware
    from fxshard.cost.profile import S, model_profile
    from fxshard.cost.timemodel import Evaluator, single_step

    ev = Evaluator(model_profile(model, dtype="fp32"), load_hardware(out), "fp32")
    rows, seq = max(1, ev.profile.batch // world), int(ev.profile.example[S])
    predicted = single_step(ev, rows, seq)
    profile = profile | {"compute_scale": round(measured / predicted, 4)}
    profile["measured"] = profile["measured"] | {"model_step": {"model": str(model), "rows": rows, "seq": seq,
                                                                "seconds": measured, "roofline_seconds": predicted}}
    from fxshard.files import write_text

    write_text(out, json.dumps(profile, indent=2) + "\n", PROFILE)
    return profile


def _overlap(device, quick: bool) -> float:
    """The share of the shorter of an all-reduce and a run of matmuls hidden when the all-reduce is in flight
    during the matmuls (1: all of it; 0: they take as long as one after the other)."""
    if dist.get_world_size() < 2:
        return 1.0
    buf = torch.ones(2**20 if quick else 2**22, device=device)
    n = 512 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device)
    one = _timed(lambda: a @ a, device, 3)
    talk = _timed(lambda: dist.all_reduce(buf), device, 3)
    run = max(1, round(talk / max(one, 1e-9)))

    def compute():
        for _ in range(run):
            a @ a

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    alone = _timed(compute, device, 3)
    together = _timed(both, device, 3)
    shorter = min(alone, talk)
    return min(1.0, max(0.0, (alone + talk - together) / shorter)) if shorter > 0 else 1.0


def _intra_groups(g: int, local: int, world: int) -> list[list[int]]:
    """Every rank in one group of ``g`` consecutive ranks of its node (as tp groups are laid out)."""
    return [list(range(start, start + g)) for node in range(0, world, local) for start in range(node, node + local, g)]


def _inter_groups(g: int, nodes: int, world: int) -> list[list[int]]:
    """Every rank in one group of ``g`` ranks one node apart (the same local rank on ``g`` consecutive nodes)."""
    local = world // nodes
    return [[(first + j) * local + i for j in range(g)] for first in range(0, nodes, g) for i in range(local)]


def _link(groups_of, span: int, world: int, device, quick: bool) -> dict | None:
    """Bus bandwidth and latency of a link (fitted over group sizes, sizes and collectives): for each group size
    ``g`` up to ``span`` (the ranks of a node, or the nodes), ``groups_of(g, span, world)`` puts every rank in one
    group and all groups measure at once, under load (:func:`_loaded_collective`)."""
    if span < 2:
        return None
    sizes = [2**16, 2**20, 2**22] if quick else [2**16, 2**18, 2**20, 2**22, 2**24]
    sizes_g = sorted({g for g in range(2, min(span, 8) + 1) if span % g == 0} | {span})  # tp's sizes, and all
    load = _Load(device)
    points = []
    for g in sizes_g:
        groups = groups_of(g, span, world)
        handles = [dist.new_group(members) for members in groups]  # collective over the world: every rank makes each
        mine = next(h for h, members in zip(handles, groups, strict=True) if dist.get_rank() in members)
        for op in OPS:
            for nbytes in sizes:
                points.append((op, g, nbytes, _loaded_collective(op, nbytes, g, mine, device, load, quick)))
        dist.barrier()
    seconds = [None] * world  # the median over the ranks (each measured its own group) of each point, at once
    dist.all_gather_object(seconds, [t for *_, t in points])
    by_point = zip(*seconds, strict=True)  # every rank measured the same points, in the same order
    agreed = [(op, g, nbytes, statistics.median(ts)) for (op, g, nbytes, _), ts in zip(points, by_point, strict=True)]
    fit = _fit(agreed)
    fit["groups"] = {g: _fit([p for p in agreed if p[1] == g], keep=False) for g in sizes_g}
    fit["collectives"] = {op: {g: _fit([p for p in agreed if p[:2] == (op, g)], keep=False) for g in sizes_g}
                          for op in OPS}
    return fit


class _Load:
    """The compute a rank does between collectives while measuring them: a short run of matmuls (~1 ms alone on
    this machine's core or device), the same on every rank."""

    def __init__(self, device):
        n = 256 if device.type == "cpu" else 2048
        self.a = torch.randn(n, n, device=device)
        self.count = 4

    def __call__(self):
        for _ in range(self.count):
            self.a @ self.a


def _loaded_collective(op: str, nbytes: int, g: int, group, device, load: _Load, quick: bool) -> float:
    """Seconds one collective adds to a rank that computes between its collectives, every rank at once: ``runs`` x
    (the load, then the collective) over ``runs`` x the load alone, per collective."""
    n = nbytes // 4
    n -= n % g
    buf = torch.ones(n, device=device)
    part = torch.empty(n // g, device=device)
    fn = {"all_reduce": lambda: dist.all_reduce(buf, group=group),
          "all_gather": lambda: dist.all_gather_into_tensor(buf, part, group=group),
          "reduce_scatter": lambda: _reduce_scatter(part, buf, group)}[op]
    runs = 8 if quick else 16

    def loaded():
        for _ in range(runs):
            load()
            fn()

    def alone():
        for _ in range(runs):
            load()

    repeats = 3 if quick else 5
    with_collective, without = _timed(loaded, device, repeats), _timed(alone, device, repeats)
    return max((with_collective - without) / runs, 1e-6)


def _reduce_scatter(out, buf, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, buf, group=group)


def _fit(points: list, keep: bool = True) -> dict:
    """Least squares of ``t = steps x latency + wire / bandwidth`` (steps and wire of each point's ring collective);
    ``keep``: with the points."""
    rows = [(*ring_terms(op, g, nbytes), t) for op, g, nbytes, t in points]
    sxx = sum(s * s for s, _, _ in rows)
    sxy = sum(s * w for s, w, _ in rows)
    syy = sum(w * w for _, w, _ in rows)
    sxt = sum(s * t for s, _, t in rows)
    syt = sum(w * t for _, w, t in rows)
    det = sxx * syy - sxy * sxy
    latency = (sxt * syy - syt * sxy) / det if det else 0.0
    inverse_bw = (sxx * syt - sxy * sxt) / det if det else 0.0
    if inverse_bw <= 0:  # no slower with size (latency-bound, or noise): latency alone
        latency, inverse_bw = max(sxt / sxx if sxx else 0.0, 0.0), 1e-15
    elif latency < 0:  # bandwidth alone, through the origin
        latency, inverse_bw = 0.0, syt / syy if syy else 1e-15
    fit = {"bandwidth": 1 / inverse_bw, "latency": latency}
    if keep:
        fit["points"] = [{"op": op, "group": g, "bytes": nb, "seconds": t} for op, g, nb, t in points]
    return fit


def _machine(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"CPU ({os.cpu_count()} CPUs)"


def _memory(device, local: int) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"
