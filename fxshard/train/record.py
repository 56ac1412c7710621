"""``OUT/run.json``: what the last ``fxshard run`` of a compiled folder did, for ``fxshard report`` to find.

Rank 0 writes it after training: the steps, the losses, where ``--metrics`` and ``--trace`` wrote (relative to
the folder when inside it, so a moved folder keeps its run) and, with ``--memory-report``, each rank's measured bytes
next to the plan.  It records the digests of the rank files it ran, so a report never shows a run of an earlier compile
as this one's::

    record = read_run_record(Path("out/l"), manifest)   # None: no run of this compile
    record["trace"]                                     # 'trace' (out/l/trace), or an absolute path outside
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

RUN_RECORD = "run.json"
RUN_RECORD_WHAT = "the run record"


def write_run_record(out: Path, options, losses: list[float], memory_rows: list[dict] | None) -> Path | None:
    """Write ``out/run.json`` (None, silently, where the folder cannot be written: the run itself succeeded)."""
    from fxshard.codegen.manifest import read_manifest

    manifest = read_manifest(out)
    record = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": options.steps, "losses": losses,
              "metrics": _recorded(options.metrics, out), "trace": _recorded(options.trace, out),
              "memory": memory_rows, "digests": manifest.digests,
              "data": _data(out, options)}
    from fxshard.codegen.folder import OUT_OWNER
    from fxshard.files import write_text

    with contextlib.suppress(OSError):  # a link planted at run.json is refused before launch (train/options.py)
        return write_text(Path(out) / RUN_RECORD, json.dumps(record, indent=1, default=str) + "\n", RUN_RECORD_WHAT,
                          owner=OUT_OWNER)
    return None


def _data(out: Path, options) -> dict | None:
    """The run's token file and, packed, its padding; None for the model file's own data (or unreadable)."""
    from fxshard.errors import FxshardError
    from fxshard.train.data.checks import data_record

    try:
        return data_record(out, options.data)
    except (FxshardError, OSError):
        return None


def _recorded(path, out: Path) -> str | None:
    """``path`` relative to ``out`` when inside it, else absolute."""
    if not path:
        return None
    path, folder = Path(path).resolve(), Path(out).resolve()
    return str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)


def recorded_path(record: dict, key: str, out: Path) -> Path | None:
    """Where the run recorded ``key`` ("metrics", "trace") as a path now: relative ones are under ``out``."""
    return Path(out) / record[key] if record.get(key) else None


def read_run_record(out: Path, manifest) -> dict | None:
    """The record of the last run of ``out``'s program, or None (no run, unreadable, or an earlier compile's)."""
    try:
        record = json.loads((Path(out) / RUN_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or record.get("digests") != manifest.digests:
        return None
    return record
