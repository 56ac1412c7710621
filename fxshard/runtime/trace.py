"""Per-rank timing of stage actions and collectives, written as Chrome trace JSON (``fxshard run --trace DIR``).

Off unless :func:`start` was called: :func:`span` then returns one shared null context, so the collectives and
pipeline actions that call it on every microbatch pay an attribute read and nothing else.  On, each span is a
complete event (``"ph": "X"``) of the rank's process (``pid`` = global rank), timed with ``perf_counter_ns``
from a wall-clock origin taken once, so the ranks of one machine share a time axis.  Every rank writes
``DIR/rank<R>.json``; :func:`merge` joins them into ``DIR/trace.json``, which Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open with one process per rank and which ``fxshard report`` draws::

    start(rank=0, folder=Path("trace"))
    with span("F0", "pipeline", stage=0, microbatch=0):
        ...
    save()   # trace/rank0.json
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

MERGED = "trace.json"
RANK_WHAT, MERGED_WHAT = "a rank's trace", "the joined trace"  # what fxshard.files records the files as
DP_THREAD = 1  # the row of the collectives torch's DDP and FSDP2 run beside the rank's own work
_OFF = contextlib.nullcontext()


class _Tracer:
    def __init__(self, rank: int, folder: Path):
        self.rank, self.folder = rank, Path(folder)
        self.origin_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter_ns() + origin_ns = wall clock
        self.events: list[dict] = []

    @contextlib.contextmanager
    def span(self, name: str, cat: str, args: dict):
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter_ns(), 0, args)

    def add(self, name: str, cat: str, start: int, end: int, tid: int, args: dict) -> None:
        # list.append is atomic: a collective's completion callback may add from torch's own thread
        self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
                            "ts": (start + self.origin_ns) / 1e3, "dur": (end - start) / 1e3, "args": args})


_tracer: _Tracer | None = None


def start(rank: int, folder: str | Path) -> None:
    """Record this rank's spans from now on (``save`` writes them to ``folder``)."""
    global _tracer
    _tracer = _Tracer(rank, Path(folder))


def enabled() -> bool:
    return _tracer is not None


def span(name: str, cat: str, **args):
    """A context manager timing what runs inside as one event; a no-op while tracing is off."""
    if _tracer is None:
        return _OFF
    return _tracer.span(name, cat, args)


def interval(name: str, cat: str, start_ns: int, end_ns: int, tid: int = 0, **args) -> None:
    """One event from ``start_ns`` to ``end_ns`` (``time.perf_counter_ns()`` readings), for work that runs beside
    the rank's own thread (``tid`` 1: an all-reduce torch issues and completes while backward goes on)."""
    if _tracer is not None:
        _tracer.add(name, cat, start_ns, end_ns, tid, args)


def stop() -> None:
    """Stop tracing without writing (a run that failed: its events are dropped)."""
    global _tracer
    _tracer = None


def save() -> Path | None:
    """Write this rank's events to ``DIR/rank<R>.json`` and stop tracing; the file's path (None when off)."""
    global _tracer
    if _tracer is None:
        return None
    tracer, _tracer = _tracer, None
    meta = [{"name": "process_name", "ph": "M", "pid": tracer.rank, "tid": 0, "args": {"name": f"rank {tracer.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": tracer.rank, "tid": 0,
             "args": {"sort_index": tracer.rank}}]
    if any(e["tid"] == DP_THREAD for e in tracer.events):
        meta.append({"name": "thread_name", "ph": "M", "pid": tracer.rank, "tid": DP_THREAD,
                     "args": {"name": "dp (DDP / FSDP2 / ZeRO 1 gathers)"}})
    path = tracer.folder / f"rank{tracer.rank}.json"
    from fxshard.files import write_text  # here: importing the runtime loads nothing else of fxshard

    return write_text(path, json.dumps({"traceEvents": meta + tracer.events, "displayTimeUnit": "ms"}), RANK_WHAT)


def merge(folder: str | Path, world: int) -> Path:
    """Join ``rank0.json`` .. ``rank<world-1>.json`` of ``folder`` into ``folder/trace.json``; its path."""
    folder = Path(folder)
    events: list[dict] = []
    for rank in range(world):
        events += json.loads((folder / f"rank{rank}.json").read_text())["traceEvents"]
    from fxshard.files import write_text

    return write_text(folder / MERGED, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), MERGED_WHAT)
