"""ZeRO 1 before and after the distributed optimizer: collectives per step, bytes, step time.

samples/gpt.py at dp = 2, trained by ``fxshard run``'s own step (:meth:`fxshard.train.program.Program.step`) in
the same two processes, the contenders taking turns (:func:`benchmarks.common.interleave`):

- **before**: the recipe fxshard used until the distributed optimizer: DDP's bucketed all-reduce of the
  gradients, then torch's ``ZeroRedundancyOptimizer`` (AdamW state of each parameter on one dp rank), which
  broadcasts every parameter from its owner after the step: one broadcast per parameter tensor;
- **after**: ``--zero 1`` (:mod:`fxshard.runtime.distributed_optimizer`) with its all-gathers waited for in the step
  (``--no-overlap-param-gather``): one reduce-scatter of each flat gradient bucket and one all-gather of each
  parameter bucket; at the default bucket size, and with small buckets (``--zero-bucket-mb``) to show the count
  growing with the buckets;
- **overlapped**: the same, each bucket's all-gather left in flight after the step and waited for by the next
  forward just before it uses the bucket (``fxshard run``'s default), compared per round with its twin above.

Each timed call is :data:`STEPS_PER_CALL` consecutive training steps and, at its end, the wait for the last step's
gathers (:func:`~fxshard.runtime.distributed_optimizer.finish_param_sync`), so a contender's gathers never run
into another contender's time: overlap can help at all but one of the call's step boundaries, and the last
gathers are paid in full.  Step times are the call's divided by :data:`STEPS_PER_CALL`.

Collectives are counted on rank 0 over one step by :class:`benchmarks.comm.CollectiveCounter` (the 8-byte loss
all-reduce every recipe issues is left out).  Bytes on the wire use ring algorithms (as
:mod:`benchmarks.comm_axes`); the textbook figure is 2(N−1)/N · 4Ψ for the reduce-scatter and all-gather
(the bytes of one all-reduce) and, before, 3(N−1)/N · 4Ψ (the all-reduce plus the broadcasts).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import combine_ranks, interleave, markdown_table, paired_ratio, spawn, summarize

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "samples" / "gpt.py"
SMALL_BUCKET_MB = 0.25
STEPS_PER_CALL = 3
SMALL = f"after, {SMALL_BUCKET_MB:g} MB buckets"
OVERLAPPED = {"after, overlapped": "after", f"{SMALL}, overlapped": SMALL}  # contender -> its twin in the step
CONTENDERS = ("before", "after", SMALL, *OVERLAPPED)


def _optims() -> dict:
    from fxshard.train.optim import OptimConfig

    small = {"zero_bucket_mb": SMALL_BUCKET_MB}
    return {"before": OptimConfig(), "after": OptimConfig(overlap_param_gather=False),
            SMALL: OptimConfig(overlap_param_gather=False, **small), "after, overlapped": OptimConfig(),
            f"{SMALL}, overlapped": OptimConfig(**small)}


def _worker(rank: int, world: int, outs: dict[str, str], rounds: int, warmup: int) -> dict:
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from benchmarks.comm import CollectiveCounter
    from fxshard.train.launch import open_stream
    from fxshard.train.options import RunOptions
    from fxshard.train.program import Program

    steps = (warmup + rounds) * STEPS_PER_CALL + 1  # and one counted step
    optims = _optims()
    runs, losses, data = {}, {}, {}
    for name, optim in optims.items():
        run = Program(Path(outs[name]), RunOptions(steps, optim), torch.device("cpu"))
        if name == "before":  # compiled at ZeRO 0 (DDP): swap its AdamW for torch's ZeRO 1 optimizer
            run._opt = ZeroRedundancyOptimizer(run.parameters(), optimizer_class=torch.optim.AdamW,
                                               process_group=run.groups["dp"], **optim.kwargs())
        runs[name], losses[name], data[name] = run, [], open_stream(run, "train")

    def stepper(name: str, steps: int = STEPS_PER_CALL):
        def call():
            for _ in range(steps):
                losses[name].append(runs[name].step(next(data[name])))
            runs[name].wait_for_parameters()  # timed: the last step's gathers are this call's
        return call

    times = interleave({name: stepper(name) for name in runs}, rounds, warmup)
    times = {name: [(w / STEPS_PER_CALL, c / STEPS_PER_CALL) for w, c in t] for name, t in times.items()}
    counts, buckets = {}, {}
    for name in runs:
        counter = CollectiveCounter()
        with counter:
            stepper(name, 1)()
        counts[name] = {k: v for k, v in counter.counts.get("step", {}).items()}
        opt = runs[name]._opt
        buckets[name] = len(opt.buckets) if hasattr(opt, "buckets") else None
    params = runs["after"].parameters()
    return {"times": times, "counts": counts, "buckets": buckets, "losses": losses,
            "psi": sum(p.numel() for p in params), "tensors": len(params)}


def run(workdir: Path, rounds: int = 20, warmup: int = 2, log=print) -> dict:
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    dp = 2
    outs = {}
    for name, zero in (("before", 0), ("after", 1)):
        outs[name] = str(workdir / f"zero1-{name}")
        compile_model(MODEL, Layout(dp=dp, zero=zero), out=outs[name])
    for name in CONTENDERS[2:]:
        outs[name] = outs["after"]
    log(f"zero1: before/after the distributed optimizer and its overlapped gathers, dp={dp}, {rounds} rounds")
    per_rank = spawn(_worker, dp, outs, rounds, warmup)
    first = per_rank[0]
    times = combine_ranks([r["times"] for r in per_rank])
    steps = summarize(times)
    wire = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
            "all_gather": lambda n: n - 1, "broadcast": lambda n: (n - 1) / n}  # x input bytes, as comm_axes
    rows = []
    for name in CONTENDERS:
        counts = {k: v for k, v in first["counts"][name].items() if v["bytes"] > 64}  # not the step loss's
        measured = sum(wire[k](dp) * v["bytes"] for k, v in counts.items())
        passes = 3 if name == "before" else 2
        textbook = passes * (dp - 1) / dp * 4 * first["psi"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(first["losses"][name], first["losses"]["before"], strict=True))
        rows.append({"recipe": name, "buckets": first["buckets"][name], "collectives": counts,
                     "calls": sum(v["calls"] for v in counts.values()), "measured_bytes": measured,
                     "textbook_bytes": textbook, "ratio": round(measured / textbook, 4), "step": steps[name],
                     "per_round": None if name == "before" else paired_ratio(times, name, "before"),
                     "vs_in_step": paired_ratio(times, name, OVERLAPPED[name]) if name in OVERLAPPED else None,
                     "loss_rel_diff": diff})
    return {"model": str(MODEL.relative_to(ROOT)), "dp": dp, "psi": first["psi"], "tensors": first["tensors"],
            "rounds": rounds, "steps_per_call": STEPS_PER_CALL, "rows": rows}


def markdown(result: dict) -> str:
    from benchmarks.comm import describe

    rows = []
    for r in result["rows"]:
        s, pr, vs = r["step"], r["per_round"], r.get("vs_in_step")
        rows.append([r["recipe"], r["buckets"] if r["buckets"] is not None else "—",
                     describe({"step": r["collectives"]}, "step"), r["calls"],
                     f"{r['measured_bytes'] / 1e6:.3f}", f"{r['textbook_bytes'] / 1e6:.3f}", f"**{r['ratio']:.3f}**",
                     f"{s['median_ms']:.1f} ({s['p25_ms']:.0f}–{s['p75_ms']:.0f})", f"{s['cpu_median_ms']:.1f}",
                     "—" if pr is None else f"{pr['median']:.3f} ({pr['p25']:.2f}–{pr['p75']:.2f})",
                     "—" if vs is None else f"**{vs['median']:.3f}** ({vs['p25']:.2f}–{vs['p75']:.2f})",
                     f"{r['loss_rel_diff']:.1e}"])
    head = (f"{result['model']} (Ψ = {result['psi']:,} parameters in {result['tensors']} tensors per rank) at dp = "
            f"{result['dp']}, rank 0, per "
            f"training step; {result['rounds']} interleaved rounds of {result.get('steps_per_call', 1)} steps each "
            "(and the wait for the last step's gathers; step ms = the round's ÷ its steps). before = DDP + "
            "ZeroRedundancyOptimizer, after = `--zero 1`'s "
            "distributed optimizer with its all-gathers waited for in the step, overlapped = left in flight until the "
            "next forward uses each bucket (the default). The step loss's 8-byte all-reduce is left out.")
    return head + "\n\n" + markdown_table(
        ["ZeRO 1 recipe", "buckets", "collectives per step", "calls", "MB on the wire", "textbook MB",
         "measured ÷ textbook", "step ms, median (p25–p75)", "CPU ms", "÷ before, per round",
         "overlapped ÷ in the step, per round", "largest relative loss difference from before"], rows)
