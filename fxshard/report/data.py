"""Everything ``fxshard report`` shows, gathered from what fxshard already wrote or computes elsewhere.

The report computes nothing of its own: the layout and rank files come from the manifest, memory per rank
from ``fxshard plan``'s cost model (:func:`fxshard.tools.costs.plan_costs`), the schedule from torch's own
schedule order (:mod:`fxshard.tools.timeline`), the run from ``OUT/run.json`` (:mod:`fxshard.train.record`),
the ``--metrics`` lines and the ``--trace`` files::

    data = report_data(Path("out/l"))
    len(data.cells), len(data.schedule.rows)   # 8 ranks, 2 pp ranks for tp=2 pp=2 dp=2
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from fxshard.codegen.manifest import Manifest, read_manifest
from fxshard.ir.layout import Coords
from fxshard.report.code import ModuleLines, highlight, rank_modules
from fxshard.tools.timeline import Slot, bubble, timeline

MEMORY_PARTS = (("params_peak", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
                ("activations", "activations"), ("transient", "transient"))


@dataclass
class Cell:
    """One rank of the mesh grid."""

    rank: int
    coords: Coords
    file: str
    holds: str
    params: int  # local parameter elements
    memory: dict[str, float]  # part -> bytes (the plan's), empty without a plan
    peak: float | None
    fits: bool | None  # against --device-memory


@dataclass
class Schedule:
    name: str
    microbatches: int
    stages_per_rank: int
    rows: dict[int, list[Slot]]  # pp rank -> planned slots
    span: int
    bubble: float  # of the timeline
    plan_bubble: float  # the plan's formula
    plan_formula: str


@dataclass
class Measured:
    """One traced step: per global rank its pipeline actions and collectives, in ms from the step's start."""

    step: int
    duration_ms: float
    rows: dict[int, list[dict]]  # rank -> events {name, cat, start, dur, args}
    perfetto: str  # the trace file to open in Perfetto


@dataclass
class RunInfo:
    losses: list[tuple[int, float]]
    seconds: list[float]
    tokens_per_step: int | None
    memory: list[dict] | None
    metrics: str | None
    when: str


@dataclass
class ReportData:
    out: Path
    manifest: Manifest
    device_memory: int | None
    cells: list[Cell]
    modules: dict[str, list[ModuleLines]]  # rank file -> its modules (file order)
    code: dict[str, list[str]]  # rank file -> highlighted lines
    schedule: Schedule
    plan_note: str = ""
    plan_rows: list[dict] = field(default_factory=list)  # per pp rank, the plan's figures (bytes)
    run: RunInfo | None = None
    measured: Measured | None = None
    warnings: list[str] = field(default_factory=list)  # what the last run recorded and the report could not read

    @property
    def layout(self):
        return self.manifest.layout


def report_data(out: str | Path, device_memory: int | None = None, metrics: Path | None = None,
                trace: Path | None = None) -> ReportData:
    """Gather the report of compiled folder ``out`` (and of its last run: ``run.json``, or the files given)."""
    from fxshard.errors import OptionError
    from fxshard.train.record import read_run_record, recorded_path

    out = Path(out)
    manifest = read_manifest(out)
    layout = manifest.layout
    plan_rows, note = _plan(out, manifest, device_memory)
    cells = _cells(manifest, plan_rows, device_memory)
    modules = {e.file: rank_modules((out / e.file).read_text(), layout.tp) for e in manifest.ranks}
    code = {e.file: highlight((out / e.file).read_text()) for e in manifest.ranks}
    record = read_run_record(out, manifest) or {}
    data = ReportData(out, manifest, device_memory, cells, modules, code, _schedule(manifest), note, plan_rows)
    given = trace is not None
    if metrics is None and (metrics := recorded_path(record, "metrics", out)) and not metrics.is_file():
        data.warnings.append(f"the last run wrote its metrics to {record['metrics']}, which is not there now; "
                             "pass --metrics FILE")
        metrics = None
    if trace is None:
        trace = recorded_path(record, "trace", out)
    data.run = _run(record, metrics, manifest)
    data.measured = measured_step(trace, layout.world_size) if trace is not None else None
    if trace is not None and data.measured is None:
        what = f"--trace {trace}" if given else f"the last run's trace, {record['trace']}"
        if given:
            raise OptionError(f"{what}: expected a folder `fxshard run --trace` wrote (trace.json or rank<R>.json "
                              "with step events); found none readable")
        data.warnings.append(f"{what}: not readable now (moved or deleted?); pass --trace DIR")
    return data


def _plan(out: Path, manifest: Manifest, device_memory: int | None) -> tuple[list[dict], str]:
    """Per pp rank the plan's bytes (``fxshard plan``), or why there are none."""
    from fxshard.errors import FxshardError
    from fxshard.tools.costs import plan_costs

    if "user" in manifest.plan_source.split("+") or (manifest.pipeline and manifest.pipeline.cut == "split_before"):
        return [], "no plan figures: compiled with a plan file or --split-before, which the folder does not record"
    try:
        report = plan_costs(out / manifest.model_file, manifest.layout, seed=manifest.seed,
                            device_memory=device_memory)
    except FxshardError as e:
        return [], f"no plan figures: {e}"
    rows = []
    for r in report.ranks:
        rows.append({key: r[key].value for key in ("params", "params_peak", "grads", "optimizer", "activations",
                                                    "transient", "peak", "saved", "alive")} | {"pp_rank": r["pp_rank"]})
    bubble = report.bubble.value if report.bubble is not None else 0.0
    for row in rows:
        row["bubble"], row["bubble_formula"] = bubble, report.bubble_formula
    return rows, ""


def _cells(manifest: Manifest, plan_rows: list[dict], device_memory: int | None) -> list[Cell]:
    layout = manifest.layout
    holds = {r.stage: r.holds for r in manifest.pipeline.table} if manifest.pipeline else {}
    cells = []
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        entry = manifest.rank(coords)
        stages = [s.index for s in entry.stages] if entry.stages else []
        what = "; ".join(f"stage {s}: {holds.get(s, '')}" for s in stages) or "the whole model"
        params = sum(math.prod(t.shape) for t in entry.tensors.values() if t.kind == "parameter")
        plan = next((r for r in plan_rows if r["pp_rank"] == coords.pp), None)
        memory = {key: plan[key] for key, _ in MEMORY_PARTS} if plan else {}
        peak = plan["peak"] if plan else None
        fits = None if device_memory is None or peak is None else peak <= device_memory
        cells.append(Cell(rank, coords, entry.file, what, params, memory, peak, fits))
    return cells


def _schedule(manifest: Manifest) -> Schedule:
    from fxshard.tools.costs import bubble_fraction

    layout = manifest.layout
    m = manifest.pipeline.microbatches if manifest.pipeline else 1
    v = manifest.pipeline.stages_per_rank if manifest.pipeline else 1
    rows = timeline(layout.schedule, layout.pp, m, v)
    expr, formula = bubble_fraction(layout)
    span = max((s.end for row in rows.values() for s in row), default=0)
    return Schedule(layout.schedule, m, v, rows, span, bubble(rows), float(expr), formula)


def _run(record: dict, metrics: Path | None, manifest: Manifest) -> RunInfo | None:
    """The losses and step times of the last run (the --metrics lines; run.json's losses without them)."""
    from fxshard.train.progress import tokens_per_step

    losses, seconds, tokens = [], [], tokens_per_step(manifest)
    if metrics is not None and metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            losses.append((row["step"], row["loss"]))
            if "seconds" in row:
                seconds.append(row["seconds"])
            tokens = row.get("tokens", tokens)
    elif record.get("losses"):
        losses = list(enumerate(record["losses"], start=record["steps"] - len(record["losses"]) + 1))
    if not losses:
        return None
    return RunInfo(losses, seconds, tokens, record.get("memory"), str(metrics) if metrics else None,
                   record.get("time", ""))


def measured_step(trace: Path, world: int) -> Measured | None:
    """The last step every rank traced (``trace.json``, or the per-rank files), its events relative to its start."""
    from fxshard.runtime.trace import MERGED

    path = trace / MERGED if trace.is_dir() else trace
    try:
        if path.is_file():
            events = json.loads(path.read_text())["traceEvents"]
        else:
            events = [e for r in range(world) for e in json.loads((trace / f"rank{r}.json").read_text())["traceEvents"]]
    except (OSError, json.JSONDecodeError, KeyError):
        return None
    steps = [e for e in events if e.get("cat") == "step" and e["name"].startswith("step ")]
    if not steps:
        return None
    last = max(e["args"]["step"] for e in steps)
    windows = {e["pid"]: (e["ts"], e["ts"] + e["dur"]) for e in steps if e["args"]["step"] == last}
    origin = min(w[0] for w in windows.values())
    rows: dict[int, list[dict]] = {r: [] for r in sorted(windows)}
    for e in events:
        w = windows.get(e.get("pid"))
        if e.get("ph") != "X" or w is None or not (w[0] <= e["ts"] <= w[1]) or e.get("cat") == "step" \
                and e["name"].startswith("step "):
            continue
        rows[e["pid"]].append({"name": e["name"], "cat": e["cat"], "start": (e["ts"] - origin) / 1e3,
                               "dur": e["dur"] / 1e3, "args": e.get("args", {})})
    duration = max(w[1] for w in windows.values()) - origin
    return Measured(last, duration / 1e3, rows, str(path))
