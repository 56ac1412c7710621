"""Step-time overhead of activation recompute: ``--recompute none``, ``selective`` and ``full``, interleaved.

The activations benchmark's model (samples/gpt.py's architecture, 4 layers, bf16, at each of :data:`SHAPES`) is
compiled once per mode at tp = 1 and tp = 2.  One set of gloo processes per tp holds the three programs, each set up the
way ``fxshard run`` sets a rank up (:class:`fxshard.train.program.Program`: weights, mixed precision, AdamW), and
:func:`benchmarks.common.interleave` runs one training step (``Program.step``: forward, backward, clipping, the
optimizer step) of each mode in turn, the order rotating every round.  Reported per mode: the median step time,
and the median over rounds of its time ÷ ``none``'s in the same round.  Every mode trains the same batches from
the same weights, so their losses must agree step by step (recompute is exact): the largest relative
difference from ``none`` is reported, with the collectives one step of each mode issues (under tp, recompute
repeats the block's collectives that the recomputed part needs).

Korthikanti et al. 2022 measured selective recompute at 2.7% more FLOPs (GPT-3 175B) and full at 36–39%; the
issue's targets are ≤ 10% and ≤ 40% more step time.  On a shared 2-core CPU the elementwise ops selective
recompute repeats (norms, GELU, residual adds) weigh more against the matrix multiplies than on a GPU.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.activations import QUICK_SHAPE, SHAPE, model_file
from benchmarks.comm import CollectiveCounter
from benchmarks.common import combine_ranks, interleave, markdown_table, paired_ratio, spawn, summarize

MODES = ("none", "selective", "full")
TPS = (1, 2)
LAYERS = 4
# the activation benchmark's shape, and one 4x wider at twice the sequence, where the matrix multiplies weigh
# more against the per-op costs (elementwise kernels, Python dispatch) that recompute repeats
SHAPES = {"h256": SHAPE, "h1024": {"vocab": 512, "seq": 512, "hidden": 1024, "heads": 8, "batch": 1}}


def _worker(rank: int, world: int, outs: dict[str, str], rounds: int, warmup: int) -> dict:
    import torch

    from fxshard.train.launch import open_stream
    from fxshard.train.options import RunOptions
    from fxshard.train.program import Program

    total = rounds + warmup + 1  # and the counted step
    runs = {mode: Program(Path(out), RunOptions(total), torch.device("cpu")) for mode, out in outs.items()}
    data = {mode: open_stream(run, "train") for mode, run in runs.items()}
    losses: dict[str, list[float]] = {mode: [] for mode in outs}

    def stepper(mode):
        def step():
            losses[mode].append(runs[mode].step(next(data[mode])))
        return step

    times = interleave({mode: stepper(mode) for mode in outs}, rounds=rounds, warmup=warmup)
    counts = {}
    for mode in outs:  # one more step each, its collectives counted: recompute may issue a block's again
        counter = CollectiveCounter()
        with counter:
            stepper(mode)()
        counts[mode] = {kind: c["calls"] for kind, c in counter.counts.get("step", {}).items()}
    return {"times": times, "losses": losses, "collectives": counts}


def run(workdir: Path, rounds: int, warmup: int, quick: bool = False, log=print) -> dict:
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    shapes = {"quick": QUICK_SHAPE} if quick else SHAPES
    results = []
    for (label, shape), tp in ((item, tp) for item in shapes.items() for tp in TPS):
        path = model_file(workdir, LAYERS, shape)
        outs = {mode: str(compile_model(path, Layout(tp=tp, recompute=mode, dtype="bf16"),
                                        out=workdir / f"recompute-{label}-tp{tp}-{mode}").out) for mode in MODES}
        log(f"recompute: {label} tp={tp}, {rounds} interleaved rounds of {', '.join(MODES)}")
        per_rank = spawn(_worker, tp, outs, rounds, warmup, timeout=900)
        combined = combine_ranks([r["times"] for r in per_rank])
        losses = per_rank[0]["losses"]
        results.append({
            "shape": shape, "tp": tp, "step_ms": summarize(combined),
            "ratio_to_none": {m: paired_ratio(combined, m, "none") for m in MODES[1:]},
            "ratio_of_medians": {m: round(statistics.median(combined[m]["wall"])
                                          / statistics.median(combined["none"]["wall"]), 3) for m in MODES[1:]},
            "cpu_ratio_of_medians": {m: round(statistics.median(combined[m]["cpu"])
                                              / statistics.median(combined["none"]["cpu"]), 3) for m in MODES[1:]},
            "collectives_per_step": per_rank[0]["collectives"],
            "max_rel_loss_diff": {m: max(abs(a - b) / abs(b) for a, b in zip(losses[m], losses["none"], strict=True))
                                  for m in MODES[1:]},
        })
    return {"model": "samples/gpt.py architecture", "layers": LAYERS, "dtype": "bf16",
            "rounds": rounds, "warmup_rounds": warmup, "targets": {"selective": 1.10, "full": 1.40}, "rows": results}


def markdown(result: dict) -> str:
    head = (f"{result['model']}, {result['layers']} layers, {result['dtype']}; {result['rounds']} interleaved "
            f"rounds after "
            f"{result['warmup_rounds']} warm-up; one step = forward, backward, AdamW (`fxshard run`'s step). "
            "Targets: selective ≤ 1.10× none, full ≤ 1.40×.")
    rows = []
    for r in result["rows"]:
        for mode in MODES:
            t = r["step_ms"][mode]
            paired = r["ratio_to_none"].get(mode)
            sh = r["shape"]
            layout = f"h={sh['hidden']} a={sh['heads']} s={sh['seq']} b={sh['batch']}, tp={r['tp']}"
            rows.append([layout if mode == "none" else "", mode,
                         f"{t['median_ms']:.1f} ({t['p25_ms']:.0f}–{t['p75_ms']:.0f})", f"{t['cpu_median_ms']:.1f}",
                         "—" if paired is None else f"**{paired['median']:.3f}** "
                                                    f"({paired['p25']:.2f}–{paired['p75']:.2f})",
                         "—" if mode == "none" else f"{r['ratio_of_medians'][mode]:.3f}",
                         "—" if mode == "none" else f"{r['cpu_ratio_of_medians'][mode]:.3f}",
                         _calls(r["collectives_per_step"][mode]),
                         "—" if mode == "none" else f"{r['max_rel_loss_diff'][mode]:.1e}"])
    table = markdown_table(["shape, layout", "recompute", "step ms, median (p25–p75)", "CPU ms per step, all ranks",
                            "÷ none, per round: median (p25–p75)", "÷ none, medians", "÷ none, CPU",
                            "collectives per step (rank 0)", "largest relative loss difference from none"], rows)
    return "\n\n".join([head, table])


def _calls(counts: dict) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "none"
