"""Overlap of the column-parallel input gradient's all-reduce with the weight gradients, eager vs overlapped.

The same model (``benchmarks/models/gpt.py``) compiled twice at tp=2: ``--no-overlap`` writes ``rt.copy_to`` and
the linears reading it (autograd computes each linear's input and weight gradients together, then the
``copy_to`` all-reduces the summed input gradient with nothing left to run beside it); the default writes
``rt.copy_to_linears``, whose backward starts that all-reduce before the weight gradients and waits after them.
Both run in the same two gloo processes, interleaved step by step (:func:`benchmarks.common.interleave`), with
the AdamW `fxshard run` uses; their losses must be equal to the bit (the gradients are the same values).
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import combine_ranks, interleave, markdown_table, paired_ratio, ratio, spawn, summarize
from benchmarks.tp_step import MODEL_FILE, TP, fxshard_contender, model_and_batch, model_size

CONTENDERS = ("overlapped", "eager")


def _worker(rank: int, world: int, outs: dict, size: str, rounds: int, warmup: int) -> dict:
    _, inputs, _ = model_and_batch(size)
    contenders = {name: fxshard_contender(Path(outs[name]), inputs) for name in CONTENDERS}
    times = interleave({name: c.step for name, c in contenders.items()}, rounds=rounds, warmup=warmup)
    return {"times": times, "losses": {n: c.losses for n, c in contenders.items()}}


def run(size: str, workdir: Path, rounds: int, warmup: int, log=print) -> dict:
    """Compile both ways, time them interleaved at tp=2; the result as JSON-ready data."""
    from benchmarks.models.gpt import SIZES
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    outs = {}
    with model_size(size):
        for name in CONTENDERS:
            outs[name] = str(workdir / f"gpt-{size}-tp{TP}-{name}")
            compile_model(MODEL_FILE, Layout(tp=TP, overlap=name == "overlapped"), out=Path(outs[name]))
    fused = Path(outs["overlapped"], "rank_pp0_tp0.py").read_text().count("rt.copy_to_linears(")
    log(f"overlap {size}: {fused} rt.copy_to_linears calls; {rounds} interleaved rounds of {', '.join(CONTENDERS)}")
    start = time.perf_counter()
    per_rank = spawn(_worker, TP, outs, size, rounds, warmup)
    combined = combine_ranks([r["times"] for r in per_rank])
    step_ms = summarize(combined)
    losses = per_rank[0]["losses"]
    same = losses["overlapped"] == losses["eager"]
    log(f"  overlapped ÷ eager per round {paired_ratio(combined, 'overlapped', 'eager')['median']:.3f}; losses "
        f"{'equal to the bit' if same else 'DIFFER'} ({time.perf_counter() - start:.0f} s)")
    return {"model": {"size": size, **SIZES[size]}, "tp": TP, "rounds": rounds, "warmup_rounds": warmup,
            "fused_calls": fused, "step_ms": step_ms, "losses_equal": same,
            "ratios": {"overlapped/eager": ratio(step_ms["overlapped"]["median_ms"], step_ms["eager"]["median_ms"]),
                       "cpu overlapped/eager": ratio(step_ms["overlapped"]["cpu_median_ms"],
                                                     step_ms["eager"]["cpu_median_ms"]),
                       "paired overlapped/eager": paired_ratio(combined, "overlapped", "eager")}}


def markdown(results: list[dict]) -> str:
    rows = []
    for r in results:
        m, q = r["model"], r["ratios"]
        p = q["paired overlapped/eager"]
        rows.append([f"{m['size']}: {m['layers']}×{m['hidden']}, {m['batch']}×{m['seq']} tokens", r["fused_calls"],
                     f"{r['step_ms']['eager']['median_ms']:.1f}", f"{r['step_ms']['overlapped']['median_ms']:.1f}",
                     f"**{p['median']:.3f}** ({p['p25']:.2f}–{p['p75']:.2f})", f"{q['cpu overlapped/eager']:.3f}",
                     "yes" if r["losses_equal"] else "NO"])
    header = ["model", "rt.copy_to_linears per rank", "eager step ms (median)", "overlapped step ms (median)",
              "overlapped ÷ eager, per round: median (p25–p75)", "overlapped ÷ eager, CPU", "losses equal to the bit"]
    first = results[0]
    return ("Step = forward + backward + AdamW at tp=2 (gloo, one intra-op thread per process), "
            f"{first['rounds']} interleaved rounds after {first['warmup_rounds']} warm-up rounds: the default "
            "(`rt.copy_to_linears`, the backward all-reduce of each column-parallel input overlapped with the weight "
            "gradients) against `--no-overlap` (the all-reduce after them).\n\n" + markdown_table(header, rows))
