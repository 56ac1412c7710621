"""``fxshard report OUT``: one self-contained HTML page (inline CSS, SVG and a little JS; nothing fetched).

The page is the template ``templates/report.html.j2`` filled from :func:`fxshard.report.data.report_data`;
this module only turns numbers into what the template draws (sizes as text, bars and timeline boxes as
positions)::

    write_report(Path("out/l"))   # (out/l/report.html, [warnings])
"""

from __future__ import annotations

import math
from pathlib import Path

import jinja2

from fxshard import units
from fxshard.files import write_text
from fxshard.ir.layout import Coords
from fxshard.report.data import MEMORY_PARTS, ReportData, report_data

REPORT = "report.html"
ACTION_NAMES = {"F": "forward", "B": "backward", "I": "backward (input gradient)", "W": "backward (weight gradient)"}


def write_report(out: str | Path, device_memory: int | None = None, metrics: Path | None = None,
                 trace: Path | None = None, path: Path | None = None,
                 model: Path | None = None) -> tuple[Path, list[str]]:
    """Write the report of compiled folder ``out`` to ``path`` (default ``out/report.html``; never through a link);
    its path, and what the last run recorded that could not be read (also on the page).  ``model``: the model file
    ``out`` was compiled from, for the plan's memory figures (nothing of ``out`` runs)."""
    data = report_data(out, device_memory, metrics, trace, model)
    if path is None:  # in the compiled folder: fxshard's by its manifest, as run.json is
        from fxshard.codegen.folder import OUT_OWNER

        write_text(Path(out) / REPORT, render(data), "the report", owner=OUT_OWNER)
        return Path(out) / REPORT, data.warnings
    write_text(path, render(data), "the report")
    return path, data.warnings


def render(data: ReportData) -> str:
    import torch

    from fxshard.version import __version__

    env = jinja2.Environment(loader=jinja2.PackageLoader("fxshard.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["size"] = human_bytes
    template = env.get_template("report.html.j2")
    return template.render(d=data, m=data.manifest, layout=data.layout, parts=MEMORY_PARTS, bar_scale=_bar_scale(data),
                           grid=_grid(data), pp_files=_pp_files(data), per_step=_per_step(data),
                           loss=_loss_curve(data), measured_rows=_measured_rows(data), actions=ACTION_NAMES,
                           versions={"fxshard": __version__, "torch": torch.__version__})


def human_bytes(n: float | None) -> str:
    return "—" if n is None else units.human_bytes(n)


def _bar_scale(data: ReportData) -> float:
    """Bytes a full memory bar stands for: the device, or the largest predicted peak."""
    peaks = [c.peak for c in data.cells if c.peak is not None]
    return float(data.device_memory or max(peaks, default=1) or 1)


def _grid(data: ReportData) -> list[list[list]]:
    """Cells as dp blocks of pp rows of tp columns."""
    layout = data.layout
    return [[[data.cells[layout.rank_of(dp=d, pp=p, tp=t)] for t in range(layout.tp)] for p in range(layout.pp)]
            for d in range(layout.dp)]


def _pp_files(data: ReportData) -> list[str]:
    """The tp-rank-0 file of each pp rank: the module list shows one per pp rank (tp ranks hold equal shares)."""
    return [data.manifest.rank(Coords(pp=p)).file for p in range(data.layout.pp)]


def _per_step(data: ReportData) -> int:
    """How many times a stage's code runs per optimizer step (its microbatches)."""
    return data.manifest.pipeline.microbatches if data.manifest.pipeline else 1


def _loss_curve(data: ReportData, width: int = 560, height: int = 200, pad: int = 40) -> dict | None:
    if data.run is None or not data.run.losses:
        return None
    drawn = [(s, v) for s, v in data.run.losses if math.isfinite(v)]  # a non-finite loss: said, not drawn
    if not drawn:
        return None
    steps = [s for s, _ in drawn]
    values = [v for _, v in drawn]
    lo, hi = min(values), max(values)
    first, last = min(steps), max(steps)
    span = max(last - first, 1)

    def up(v: float) -> float:  # 0 at the lowest loss, 1 at the highest; halves: hi - lo of two huge finite losses
        return (v / 2 - lo / 2) / (hi / 2 - lo / 2) if hi > lo else 0.5  # (1e308, -1e308) would overflow to inf

    points = [(pad + (s - first) / span * (width - 2 * pad), height - pad - up(v) * (height - 2 * pad))
              for s, v in drawn]
    return {"width": width, "height": height, "pad": pad, "points": points, "lo": lo, "hi": hi, "first": first,
            "last": last, "path": " ".join(f"{x:.1f},{y:.1f}" for x, y in points)}


def _measured_rows(data: ReportData) -> list[tuple[int, dict, list[dict]]]:
    """The traced ranks ordered as the schedule's rows are: by pp rank, then dp, then tp."""
    if data.measured is None:
        return []
    layout = data.layout
    order = sorted(data.measured.rows, key=lambda r: (layout.coords(r).pp, layout.coords(r).dp,
                                                      layout.coords(r).tp))
    return [(r, layout.coords(r), data.measured.rows[r]) for r in order]
