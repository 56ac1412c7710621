"""Everything ``fxshard report`` shows, gathered from what fxshard already wrote or computes elsewhere.

The report computes nothing of its own, and runs no code of the folder it reads (a folder received from someone
else is looked at, not run): the layout comes from the manifest, the rank files are read as text, the schedule
from torch's own schedule order (:mod:`fxshard.cost.timeline`), the run from ``OUT/run.json``
(:mod:`fxshard.train.record`), the ``--metrics`` lines and the ``--trace`` files.  Memory per rank is ``fxshard
plan``'s cost model (:func:`fxshard.cost.costs.plan_costs`), which imports a model file: only one the user
names (``model``), and only when it is the file the folder was compiled from (its recorded sha256)::

    data = report_data(Path("out/l"), model=Path("samples/llama.py"))
    len(data.cells), len(data.schedule.rows)   # 8 ranks, 2 pp ranks for tp=2 pp=2 dp=2
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from fxshard.codegen.manifest import Manifest, read_manifest
from fxshard.cost.timeline import Slot, bubble, timeline
from fxshard.ir.layout import Coords
from fxshard.report.code import ModuleLines, highlight, rank_modules
from fxshard.train.record import RUN_RECORD

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
    seconds: list[float | None]  # per step of ``losses``; None: not recorded
    tokens_per_step: int | None
    memory: list[dict] | None
    metrics: str | None
    when: str
    data: dict | None = None  # the run's --data token file and, packed, the padding (fxshard.train.data.checks)


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
                trace: Path | None = None, model: Path | None = None) -> ReportData:
    """Gather the report of compiled folder ``out`` (and of its last run: ``run.json``, or the files given);
    ``model``: the model file ``out`` was compiled from, for the plan's memory figures."""
    from fxshard.errors import OptionError
    from fxshard.train.record import read_run_record, recorded_path

    out = Path(out)
    manifest = read_manifest(out)
    layout = manifest.layout
    plan_rows, note = _plan(manifest, device_memory, model)
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
    data.run = _run(record, metrics, manifest, data.warnings)
    data.measured = measured_step(trace, layout.world_size) if trace is not None else None
    if trace is not None and data.measured is None:
        what = f"--trace {trace}" if given else f"the last run's trace, {record['trace']}"
        if given:
            raise OptionError(f"{what}: expected a folder `fxshard run --trace` wrote (trace.json or rank<R>.json "
                              "with step events); found none readable")
        data.warnings.append(f"{what}: not readable now (moved or deleted?); pass --trace DIR")
    return data


def _plan(manifest: Manifest, device_memory: int | None, model: Path | None) -> tuple[list[dict], str]:
    """Per pp rank the plan's bytes (``fxshard plan`` of ``model``, the user's own copy of the model file), or why
    there are none.  Never the folder's ``model.py``: reading a folder runs none of its code."""
    from fxshard.cost.costs import plan_costs
    from fxshard.errors import FxshardError

    if "user" in manifest.plan_source.split("+") or (manifest.pipeline and manifest.pipeline.cut == "split_before"):
        return [], "no plan figures: compiled with a plan file or --split-before, which the folder does not record"
    if model is None:
        return [], (f"no plan figures: the report runs no code of the folder it reads; pass --model with your copy of "
                    f"{manifest.model_name or 'the model file'} (the file it was compiled from) to draw each rank's "
                    "memory by the plan")
    _same_model(model, manifest)
    try:
        report = plan_costs(model, manifest.layout, seed=manifest.seed, device_memory=device_memory)
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


def _same_model(model: Path, manifest: Manifest) -> None:
    """``--model`` is the file the folder was compiled from (sha256), before it is imported."""
    import hashlib

    from fxshard.errors import OptionError

    if not Path(model).is_file():
        raise OptionError(f"--model {model}: no such file; name the model file the folder was compiled from")
    found = hashlib.sha256(Path(model).read_bytes()).hexdigest()[:16]
    if found != manifest.model_digest:
        raise OptionError(f"--model {model}: is not the model file the folder was compiled from (sha256 {found}, the "
                          f"manifest records {manifest.model_digest} for {manifest.model_name}); name that file")


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
    from fxshard.cost.costs import bubble_fraction

    layout = manifest.layout
    m = manifest.pipeline.microbatches if manifest.pipeline else 1
    v = manifest.pipeline.stages_per_rank if manifest.pipeline else 1
    rows = timeline(layout.schedule, layout.pp, m, v)
    expr, formula = bubble_fraction(layout)
    span = max((s.end for row in rows.values() for s in row), default=0)
    return Schedule(layout.schedule, m, v, rows, span, bubble(rows), float(expr), formula)


def _run(record: dict, metrics: Path | None, manifest: Manifest, warnings: list[str]) -> RunInfo | None:
    """The losses and step times of the last run (the --metrics lines; run.json's losses without them).  A line
    whose step or loss is not a number is left out and said in ``warnings``; a non-finite loss (a run that
    stopped on it) stays in the table, and the curve draws the finite ones."""
    from fxshard.train.progress import tokens_per_step

    losses, seconds, tokens = [], [], tokens_per_step(manifest)
    if metrics is not None and metrics.is_file():
        for number, line in enumerate(metrics.read_text(errors="replace").splitlines(), start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            step, loss = (row.get("step"), row.get("loss")) if isinstance(row, dict) else (None, None)
            if not (_is_number(step) and float(step).is_integer() and _is_number(loss)):
                warnings.append(f"{metrics} line {number}: expected a step and a loss that are numbers; found "
                                f"{_short(line)}; not drawn")
                continue
            losses.append((int(step), float(loss)))
            sec = row.get("seconds")
            seconds.append(float(sec) if _is_number(sec) and math.isfinite(sec) and sec > 0 else None)
            if isinstance(row.get("tokens"), int) and not isinstance(row.get("tokens"), bool):
                tokens = row["tokens"]
    elif isinstance(record.get("losses"), list) and isinstance(record.get("steps"), int):
        values = record["losses"]
        if all(_is_number(v) for v in values):
            losses = [(i, float(v)) for i, v in enumerate(values, start=record["steps"] - len(values) + 1)]
        else:
            warnings.append(f"{RUN_RECORD}: its losses are not all numbers; not drawn")
    if not losses:
        return None
    for step, value in losses:
        if not math.isfinite(value):
            warnings.append(f"step {step}: loss {value} (not a finite number; the curve leaves it out)")
    memory = record.get("memory")
    if memory is not None and not _memory_rows(memory):
        warnings.append(f"{RUN_RECORD}: its memory rows are not what `fxshard run --memory-report` writes; not shown")
        memory = None
    data = record.get("data")
    if data is not None and not _data_record(data):
        warnings.append(f"{RUN_RECORD}: its data record is not what `fxshard run --data` writes; not shown")
        data = None
    return RunInfo(losses, seconds, tokens, memory, str(metrics) if metrics else None, str(record.get("time", "")),
                   data)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _memory_rows(rows) -> bool:
    """run.json's memory rows have the fields and numbers the page reads."""
    keys = ("params", "grads", "optimizer", "saved", "peak")
    return isinstance(rows, list) and all(
        isinstance(r, dict) and isinstance(r.get("rank"), int) and isinstance(r.get("coords"), dict)
        and all(_is_number(r.get(k)) for k in keys)
        and (r.get("plan") is None or isinstance(r["plan"], dict) and all(_is_number(r["plan"].get(k))
                                                                          for k in ("saved", "peak")))
        for r in rows)


def _data_record(data) -> bool:
    """run.json's data record (fxshard.train.data.checks.data_record) has the fields and numbers the page reads."""
    padding = data.get("padding") if isinstance(data, dict) else None
    return isinstance(data, dict) and isinstance(data.get("source"), str) and (padding is None or (
        isinstance(padding, dict) and all(_is_number(padding.get(k)) for k in ("packed", "unpacked", "documents",
                                                                                 "sequences"))))


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
