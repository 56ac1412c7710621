"""The time model against measurement: ``fxshard calibrate``, then predict and measure 12 layouts at world size 4.

This machine is measured first (``fxshard calibrate --procs 4 --model`` this benchmark's model: matmul FLOP/s,
memory bandwidth, each gloo collective over groups of 2 and 4 processes under load, selective recompute's cost per
op, and the model's own forward and backward against the roofline, ``compute_scale``), then for each layout of
:data:`LAYOUTS` (tp, pp, dp, ZeRO and recompute mixed) the time model predicts one step of
:mod:`benchmarks.models.auto_llama` from that profile, and ``fxshard compile`` + ``fxshard run --steps N --metrics``
measure it, in :data:`ROUNDS` rounds over the layouts, each round in its own shuffled order (the machine is shared:
its load moves within a round and between rounds, and a fixed order would give the same layouts the same
neighbours). A run's step is the median of its steps after the first two; a layout's measured step is the least of
its rounds' (load only ever adds time), its median over rounds reported beside it. Reported: each layout's predicted
and measured step and their ratio, the Spearman rank correlation of the two orders (issue 33's target: at least
0.8), the measured step of the predicted best against the measured best (target: within 10%), and the rounds'
agreement with each other (the Spearman of every pair of rounds: how well the measurement ranks itself, the ceiling
for any model).

    python -m benchmarks.run --only auto           # results/auto-cpu.md and .json
"""

from __future__ import annotations

import itertools
import json
import os
import random
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
ROUNDS, STEPS = 3, 6  # rounds over the 12 layouts; steps per run (the first two not measured)
L = Layout
LAYOUTS = [
    L(dp=4), L(dp=4, zero=1), L(dp=4, zero=3), L(dp=4, recompute="full"),
    L(tp=4), L(tp=2, dp=2), L(tp=2, dp=2, zero=1, recompute="selective"), L(tp=2, dp=2, sp=True),
    L(pp=2, dp=2, microbatches=2), L(pp=4, microbatches=4), L(pp=2, tp=2, schedule="gpipe", microbatches=4),
    L(pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=2, recompute="full"),
]


def run(work: Path, quick: bool = False, profile: Path | None = None, quick_calibrate: bool = False) -> dict:
    """Calibrate (unless ``profile`` names one; ``quick_calibrate``: three sizes of each collective rather than five,
    20 s rather than a minute on this machine, and noisier), predict and measure every layout; the table's rows and
    summary."""
    from fxshard.cost.hardware import load_hardware
    from fxshard.cost.profile import model_profile
    from fxshard.cost.timemodel import Evaluator, Setting, predict

    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if profile is None:
        profile = work / "calibrated.json"
        subprocess.run([sys.executable, "-m", "fxshard.cli.app", "calibrate", "--procs", str(WORLD), "--out",
                        str(profile), "--model", str(MODEL)] + (["--quick"] if quick or quick_calibrate else []),
                       check=True, capture_output=True)
    hw = load_hardware(profile)
    calibrated = time.perf_counter() - started
    (RESULTS_COPY).write_text(Path(profile).read_text())  # the profile the predictions used, kept with the results
    ev = Evaluator(model_profile(MODEL, dtype="fp32"), hw, "fp32")
    setting = Setting(128, 8, WORLD)
    steps, rounds = (4, 1) if quick else (STEPS, ROUNDS)
    layouts = LAYOUTS[:3] if quick else LAYOUTS
    runs, failed = _measure_rounds(work, layouts, steps, rounds)
    rows = []
    for layout in layouts:
        name = layout.describe()
        if name not in runs or any(f["layout"] == name for f in failed):
            continue
        pred = predict(ev, layout, setting)
        medians = [statistics.median(run) for run in runs[name]]
        rows.append({"layout": name, "predicted_s": pred.step, "measured_s": min(medians),
                     "median_s": statistics.median(medians), "runs_s": medians, "ratio": pred.step / min(medians),
                     "compute_s": pred.compute, "exposed_s": sum(pred.exposed.values()), "bubble_s": pred.bubble,
                     "terms_s": pred.terms})
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    best_predicted = min(range(len(rows)), key=predicted.__getitem__)
    return {"rows": rows, "failed": failed, "spearman": spearman(predicted, measured),
            "spearman_median": spearman(predicted, [r["median_s"] for r in rows]),
            "spearman_rounds": [spearman(predicted, [r["runs_s"][i] for r in rows]) for i in range(rounds)
                                if all(len(r["runs_s"]) > i for r in rows)],
            "agreement": agreement(rows, rounds),
            "best_predicted": rows[best_predicted]["layout"],
            "best_measured": rows[measured.index(min(measured))]["layout"],
            "regret": measured[best_predicted] / min(measured) - 1, "profile": hw.name, "profile_source": hw.source,
            "peak_fp32": hw.peak("fp32"), "link": {"bandwidth": hw.intra_node.bandwidth,
                                                   "latency": hw.intra_node.latency},
            "kernel_overhead": hw.kernel_overhead, "overlap": hw.overlap, "contention": hw.contention,
            "compute_scale": hw.compute_scale, "selective_overhead": hw.selective_overhead,
            "groups": {g: {"bandwidth": k.bandwidth, "latency": k.latency} for g, k in hw.groups.items()},
            "calibrate_s": calibrated, "steps": steps, "rounds": rounds,
            "load_average": os.getloadavg()}


def _measure_rounds(work: Path, layouts, steps: int, rounds: int) -> tuple[dict, list]:
    """Compile every layout once, then run each once per round, each round in its own order (the first as listed,
    the others shuffled with the round as seed): layout name -> one list of step seconds per round."""
    from fxshard.driver import compile as compile_

    runs: dict[str, list[list[float]]] = {}
    failed: list[dict] = []
    for round_ in range(rounds):
        order = list(layouts)
        if round_:
            random.Random(round_).shuffle(order)
        for layout in order:
            name = layout.describe()
            if any(f["layout"] == name for f in failed):
                continue
            out = work / name.replace(" ", "_").replace("=", "")
            try:
                if name not in runs:
                    compile_(MODEL, layout, out=out)
                runs.setdefault(name, []).append(_measure(out, steps))
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FxshardError) as e:
                failed.append({"layout": name, "error": _tail(e)})
    return runs, failed


def agreement(rows: list[dict], rounds: int) -> list[float]:
    """The Spearman of every pair of rounds over the layouts measured in both: how well the measurement ranks the
    same layouts twice (the ceiling a model's ranking can reach against it)."""
    return [spearman([r["runs_s"][i] for r in rows], [r["runs_s"][j] for r in rows])
            for i, j in itertools.combinations(range(rounds), 2) if all(len(r["runs_s"]) > j for r in rows)]


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
    lines = ["| layout | predicted step | measured step (least of rounds) | rounds (medians, in round order) | "
             "predicted / measured | compute | exposed comm | bubble |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        runs = " / ".join(f"{t * 1e3:.0f}" for t in r.get("runs_s", []))
        lines.append(f"| {r['layout']} | {r['predicted_s'] * 1e3:.1f} ms | {r['measured_s'] * 1e3:.1f} ms | "
                     f"{runs} ms | "
                     f"{r['ratio']:.2f} | {r['compute_s'] * 1e3:.1f} ms | {r['exposed_s'] * 1e3:.1f} ms | "
                     f"{r['bubble_s'] * 1e3:.1f} ms |")
    for f in result.get("failed", []):
        lines.insert(2 + len(result["rows"]), f"| {f['layout']} | | failed: {f['error']} | | | | | |")
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    agree = result.get("agreement", [])
    per_round = ", ".join(f"{x:.2f}" for x in result.get("spearman_rounds", []))
    lines += ["", f"Spearman rank correlation of predicted and measured steps (least of {result['rounds']} rounds): "
              f"**{result['spearman']:.2f}** (target >= 0.8); against the median of the rounds "
              f"{result.get('spearman_median', float('nan')):.2f}; against each round alone {per_round}. "
              f"**The rounds agree with each other at " + (", ".join(f"{x:.2f}" for x in agree) or "n/a") +
              (f" (mean {statistics.mean(agree):.2f})" if agree else "") + "** (Spearman of each pair of rounds: the "
              "measurement ranking itself, the ceiling for any model). "
              f"Predicted best: {result['best_predicted']}; measured best: {result['best_measured']}; the "
              f"predicted best measured {result['regret']:.0%} slower than the measured best (target within 10%).",
              f"Profile: {result['profile']} ({result['profile_source']}): fp32 matmul "
              f"{result['peak_fp32'] / 1e9:.2f} GFLOP/s per process, gloo bus bandwidth "
              f"{result['link']['bandwidth'] / 1e6:.0f} MB/s, latency {result['link']['latency'] * 1e3:.2f} ms, "
              f"{result['kernel_overhead'] * 1e6:.1f} us per op (a third of forward + backward under "
              f"autograd), overlap "
              f"{result.get('overlap', 1.0):.2f}, contention {result.get('contention', 1.0):.2f}, compute_scale "
              f"{result.get('compute_scale', 1.0):.2f} (the model's measured forward + backward over the roofline), "
              f"selective recompute {result.get('selective_overhead', 0.0) * 1e6:.1f} us per op; per group size: "
              + ", ".join(f"{g}: {v['bandwidth'] / 1e6:.0f} MB/s, {v['latency'] * 1e3:.2f} ms"
                          for g, v in result.get("groups", {}).items())
              + f". Load average at the end {load} (a shared machine: "
              f"calibration and runs contend with other work)."]
    return "\n".join(lines)
