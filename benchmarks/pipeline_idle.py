"""Pipeline schedules: how much of a step each rank spends idle, next to the bubble theory predicts.

``benchmarks/models/mlp_stack.py`` (identical residual MLP blocks, so stages cost the same) is
compiled with ``Layout(pp=p, schedule=s, microbatches=m)`` for every schedule fxshard offers
(``fxshard.ir.context.SCHEDULES``).  One set of ``p`` processes loads all of them and steps them
interleaved.  On each rank, the generated stage modules run under ``torch.distributed.pipelining``
exactly as ``fxshard run`` drives them; :class:`BusyClock` wraps the ``PipelineStage``'s
``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` (the compute of one
microbatch; receives and sends happen outside them) and sums their wall time.  Per rank and step:

    idle fraction = 1 - busy / wall time of the schedule's step (forward and backward of all microbatches)

reported as the median over steps, averaged over ranks, next to the classic bubble
``(p-1)/(m+p-1)`` (GPipe, 1F1B) and the interleaved schedule's ``(p-1)/(v·m+p-1)`` with ``v``
stages per rank.  Zero-bubble schedules aim at no bubble at all.  Idle time also holds the
send/receive of activations and Python overhead, so measured idle is above the theory.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import interleave, markdown_table, spawn

MODEL_FILE = Path(__file__).resolve().parent / "models" / "mlp_stack.py"
CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class BusyClock:
    """Sums the wall time spent inside the compute methods of the stages it wraps."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, stage) -> None:
        for name in CHUNK_METHODS:
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, self._timed(method))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


class PipelineRunner:
    """One compiled layout on this rank: its stages, schedule and optimizer; ``step()`` records idle time."""

    def __init__(self, out: Path):
        from torch.distributed.device_mesh import init_device_mesh

        from fxshard.capture.inputs import flatten_batch
        from fxshard.capture.modelfile import load_model_file
        from fxshard.codegen.manifest import import_rank_file, read_manifest
        from fxshard.runtime import load_state
        from fxshard.runtime.pipeline import make_schedule, pipeline_stage
        from fxshard.train.optim import OptimConfig

        manifest = read_manifest(out)
        self.layout = layout = manifest.layout
        mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
        self.groups = {axis: mesh.get_group(axis) for axis in ("dp", "pp", "tp")}
        entry = manifest.rank(layout.coords(dist.get_rank()))
        code = import_rank_file(out / entry.file)
        device = torch.device("cpu")
        modules = {}
        for st in entry.stages:
            modules[st.index] = getattr(code, st.class_name)(self.groups, device)
            load_state(modules[st.index], out / entry.weights, prefix=st.class_name + ".")
        self.stages = [pipeline_stage(modules[s], s, layout.num_stages, device, self.groups["pp"])
                       for s in sorted(modules)]
        self.clock = BusyClock()
        for stage in self.stages:
            self.clock.wrap(stage)
        self.microbatches = manifest.pipeline.microbatches
        self.schedule = make_schedule(layout.schedule, self.stages, self.microbatches)
        batch = load_model_file(out / manifest.model_file).build_inputs(manifest.seed)
        self.inputs = [v for v in flatten_batch(batch, manifest.inputs) if isinstance(v, torch.Tensor)]
        self.names = [i.name for i in manifest.inputs if i.is_tensor]
        self.optimizer = OptimConfig().make([p for m in modules.values() for p in m.parameters()])
        self.samples: list[tuple[float, float]] = []  # (wall, busy) seconds per step

    def step(self) -> None:
        from fxshard.runtime.pipeline import run_schedule

        self.clock.seconds = 0.0
        start = time.perf_counter()
        run_schedule(self.schedule, self.stages, self.microbatches, self.inputs, self.groups["pp"], names=self.names)
        self.samples.append((time.perf_counter() - start, self.clock.seconds))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, outs: dict[str, str], rounds: int, warmup: int) -> dict:
    runners = {name: PipelineRunner(Path(out)) for name, out in outs.items()}
    # interleave's own times include the optimizer step; the runners record the schedule's step alone
    interleave({name: r.step for name, r in runners.items()}, rounds=rounds, warmup=warmup)
    return {name: r.samples[warmup:] for name, r in runners.items()}


def theory(pp: int, microbatches: int, stages_per_rank: int) -> dict:
    """The bubble fractions: classic ``(p-1)/(m+p-1)`` and with ``v`` stages per rank ``(p-1)/(v·m+p-1)``."""
    return {"classic": round((pp - 1) / (microbatches + pp - 1), 3),
            "interleaved": round((pp - 1) / (stages_per_rank * microbatches + pp - 1), 3)}


def run(pp: int, microbatches: int, workdir: Path, rounds: int, warmup: int, schedules=None, log=print) -> dict:
    """Compile every schedule at ``pp`` and ``microbatches``, step them interleaved; idle fractions."""
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import SCHEDULES, Layout

    schedules = schedules or SCHEDULES
    outs, layouts = {}, {}
    for s in schedules:
        out = workdir / f"mlp-pp{pp}-{s}"
        result = compile_model(MODEL_FILE, Layout(pp=pp, schedule=s, microbatches=microbatches), out=out)
        outs[s] = str(out)
        layouts[s] = result.manifest.layout
    log(f"pipeline pp={pp}: {rounds} interleaved steps of {', '.join(schedules)} ({microbatches} microbatches)")
    per_rank = spawn(_worker, pp, outs, rounds, warmup)
    rows = {}
    for s in schedules:
        v = layouts[s].virtual_stages or 1
        idle = [statistics.median(1 - busy / wall for wall, busy in samples[s]) for samples in per_rank]
        wall = statistics.median(max(w for w, _ in step) for step in zip(*(r[s] for r in per_rank), strict=True))
        rows[s] = {"stages_per_rank": v, "step_ms": round(wall * 1e3, 2),
                   "idle_fraction": round(statistics.fmean(idle), 3), "idle_by_rank": [round(x, 3) for x in idle],
                   "theory": theory(pp, microbatches, v)}
        t = rows[s]["theory"]
        log(f"  {s:17s} idle {rows[s]['idle_fraction']:.3f}  ((p-1)/(m+p-1) = {t['classic']:.3f}, "
            f"(p-1)/(v·m+p-1) = {t['interleaved']:.3f})  step {wall * 1e3:.1f} ms")
    cores = os.cpu_count() or 1
    return {"model": {"file": "benchmarks/models/mlp_stack.py"}, "pp": pp, "microbatches": microbatches,
            "rounds": rounds, "warmup_rounds": warmup, "processes": pp, "cpu_cores": cores,
            "oversubscribed": pp > cores, "schedules": rows}


def markdown(results: list[dict]) -> str:
    """The idle-fraction table: one row per (pp, schedule)."""
    rows = []
    for r in results:
        for s, row in r["schedules"].items():
            t = row["theory"]
            rows.append([r["pp"], r["microbatches"], s, row["stages_per_rank"], f"{row['step_ms']:.1f}",
                         f"**{row['idle_fraction']:.3f}**", " ".join(f"{x:.2f}" for x in row["idle_by_rank"]),
                         f"{t['classic']:.3f}", f"{t['interleaved']:.3f}" if row["stages_per_rank"] > 1 else "—"])
    header = ["pp", "microbatches m", "schedule", "stages per rank v", "step ms (median)", "idle fraction",
              "idle by rank", "(p−1)/(m+p−1)", "(p−1)/(v·m+p−1)"]
    notes = [f"pp={r['pp']} runs {r['processes']} processes on {r['cpu_cores']} cores (oversubscribed: "
             "ranks also wait for a core, which shows as busy time)" for r in results if r["oversubscribed"]]
    first = results[0]
    text = (f"Idle fraction = 1 − (time in stage forward/backward) / (schedule step time), median of "
            f"{first['rounds']} interleaved steps, mean over ranks; model benchmarks/models/mlp_stack.py.")
    return text + ("\n" + "\n".join(notes) if notes else "") + "\n\n" + markdown_table(header, rows)
