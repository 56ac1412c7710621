"""The time model against measurement: ``fxshard calibrate``, then predict and measure 12 layouts at world size 4.

This machine is measured first (``fxshard calibrate --procs 4``: matmul FLOP/s, memory bandwidth, gloo collectives
over 2 and 4 processes), then for each layout of :data:`LAYOUTS` (tp, pp, dp, ZeRO and recompute mixed) the time
model predicts one step of :mod:`benchmarks.models.auto_llama` from that profile, and ``fxshard compile`` +
``fxshard run --steps N --metrics`` measure it, twice, in two rounds over the layouts (the machine is shared: its
load moves between rounds); a layout's step is the median of both runs' steps after the first two of each, its
spread the two runs' medians.  Reported: each
layout's predicted and measured step and their ratio, the Spearman rank correlation of the two orders (issue 33's
target: at least 0.8), and the measured step of the predicted best against the measured best (target: within 10%).

    python -m benchmarks.run --only auto           # results/auto-cpu.md and .json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fxshard.errors import FxshardError
from fxshard.ir.layout import Layout

MODEL = Path(__file__).resolve().parent / "models" / "auto_llama.py"
RESULTS_COPY = Path(__file__).resolve().parent / "results" / "auto-cpu-profile.json"
WORLD = 4
L = Layout
LAYOUTS = [
    L(dp=4), L(dp=4, zero=1), L(dp=4, zero=3), L(dp=4, recompute="full"),
    L(tp=4), L(tp=2, dp=2), L(tp=2, dp=2, zero=1, recompute="selective"), L(tp=2, dp=2, sp=True),
    L(pp=2, dp=2, microbatches=2), L(pp=4, microbatches=4), L(pp=2, tp=2, schedule="gpipe", microbatches=4),
    L(pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=2, recompute="full"),
]


def run(work: Path, quick: bool = False, profile: Path | None = None, quick_calibrate: bool = True) -> dict:
    """Calibrate (unless ``profile`` names one; ``quick_calibrate``: fewer sizes, a minute rather than six on this
    shared machine), predict and measure every layout; the table's rows and summary."""
    from fxshard.driver import compile as compile_
    from fxshard.tools.hardware import load_hardware
    from fxshard.tools.profile import model_profile
    from fxshard.tools.timemodel import Evaluator, Setting, predict

    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if profile is None:
        profile = work / "calibrated.json"
        subprocess.run([sys.executable, "-m", "fxshard.cli.app", "calibrate", "--procs", str(WORLD), "--out",
                        str(profile)] + (["--quick"] if quick or quick_calibrate else []), check=True, capture_output=True)
    hw = load_hardware(profile)
    calibrated = time.perf_counter() - started
    (RESULTS_COPY).write_text(Path(profile).read_text())  # the profile the predictions used, kept with the results
    ev = Evaluator(model_profile(MODEL, dtype="fp32"), hw, "fp32")
    setting = Setting(128, 8, WORLD)
    steps, rounds = (4, 1) if quick else (8, 2)
    layouts = LAYOUTS[:3] if quick else LAYOUTS
    runs: dict[str, list[list[float]]] = {}
    failed = []
    for round_ in range(rounds):
        for layout in layouts:
            name = layout.describe()
            if any(f["layout"] == name for f in failed):
                continue
            out = work / name.replace(" ", "_").replace("=", "")
            try:
                if round_ == 0:
                    compile_(MODEL, layout, out=out)
                runs.setdefault(name, []).append(_measure(out, steps))
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FxshardError) as e:
                failed.append({"layout": name, "error": _tail(e)})
    rows = []
    for layout in layouts:
        name = layout.describe()
        if name not in runs or any(f["layout"] == name for f in failed):
            continue
        pred = predict(ev, layout, setting)
        measured = statistics.median([t for run in runs[name] for t in run])
        rows.append({"layout": name, "predicted_s": pred.step, "measured_s": measured,
                     "runs_s": [statistics.median(run) for run in runs[name]], "ratio": pred.step / measured,
                     "compute_s": pred.compute, "exposed_s": sum(pred.exposed.values()), "bubble_s": pred.bubble,
                     "terms_s": pred.terms})
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    best_predicted = min(range(len(rows)), key=predicted.__getitem__)
    return {"rows": rows, "failed": failed, "spearman": spearman(predicted, measured),
            "best_predicted": rows[best_predicted]["layout"], "best_measured": rows[measured.index(min(measured))]["layout"],
            "regret": measured[best_predicted] / min(measured) - 1, "profile": hw.name, "profile_source": hw.source,
            "peak_fp32": hw.peak("fp32"), "link": {"bandwidth": hw.intra_node.bandwidth, "latency": hw.intra_node.latency},
            "kernel_overhead": hw.kernel_overhead, "overlap": hw.overlap, "contention": hw.contention,
            "groups": {g: {"bandwidth": k.bandwidth, "latency": k.latency} for g, k in hw.groups.items()},
            "calibrate_s": calibrated, "steps": steps, "rounds": rounds,
            "load_average": os.getloadavg()}


def _tail(e: Exception) -> str:
    text = getattr(e, "stderr", None) or str(e)
    text = text.decode() if isinstance(text, bytes) else text
    return " ".join(text.strip().splitlines()[-3:])[-400:]


def _measure(out: Path, steps: int) -> list[float]:
    """Seconds of the steps after the first two, rank 0's own clock (``fxshard run --metrics``)."""
    metrics = out / "metrics.jsonl"
    subprocess.run([sys.executable, "-m", "fxshard.cli.app", "run", str(out), "--steps", str(steps), "--metrics",
                    str(metrics)], check=True, capture_output=True, timeout=900)
    seconds = [json.loads(line)["seconds"] for line in metrics.read_text().splitlines() if line.strip()]
    return seconds[2:] or seconds


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def markdown(result: dict) -> str:
    lines = ["| layout | predicted step | measured step | runs (medians) | predicted / measured | compute | exposed comm "
             "| bubble |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        runs = " / ".join(f"{t * 1e3:.0f}" for t in r.get("runs_s", []))
        lines.append(f"| {r['layout']} | {r['predicted_s'] * 1e3:.1f} ms | {r['measured_s'] * 1e3:.1f} ms | {runs} ms | "
                     f"{r['ratio']:.2f} | {r['compute_s'] * 1e3:.1f} ms | {r['exposed_s'] * 1e3:.1f} ms | "
                     f"{r['bubble_s'] * 1e3:.1f} ms |")
    for f in result.get("failed", []):
        lines.insert(2 + len(result["rows"]), f"| {f['layout']} | | failed: {f['error']} | | | | | |")
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    lines += ["", f"Spearman rank correlation of predicted and measured steps: **{result['spearman']:.2f}** (target "
              f">= 0.8). Predicted best: {result['best_predicted']}; measured best: {result['best_measured']}; the "
              f"predicted best measured {result['regret']:.0%} slower than the measured best (target within 10%).",
              f"Profile: {result['profile']} ({result['profile_source']}): fp32 matmul "
              f"{result['peak_fp32'] / 1e9:.2f} GFLOP/s per process, gloo bus bandwidth "
              f"{result['link']['bandwidth'] / 1e6:.0f} MB/s, latency {result['link']['latency'] * 1e3:.2f} ms, "
              f"{result['kernel_overhead'] * 1e6:.1f} us per op (a third of forward + backward under autograd), overlap "
              f"{result.get('overlap', 1.0):.2f}, contention {result.get('contention', 1.0):.2f}; per group size: "
              + ", ".join(f"{g}: {v['bandwidth'] / 1e6:.0f} MB/s, {v['latency'] * 1e3:.2f} ms"
                          for g, v in result.get("groups", {}).items())
              + f". Load average at the end {load} (a shared machine: "
              f"calibration and runs contend with other work)."]
    return "\n".join(lines)
