"""Pipeline and data-parallel traffic per training step: measured, the textbook figure, and ``fxshard plan``'s.

One step's traffic is measured as the difference between training 2 steps and 1 step with
``fxshard.train.launch.train`` (the code ``fxshard run`` runs), so set-up traffic (DDP's initial broadcast)
cancels out.  Collectives are counted by :class:`benchmarks.comm.CollectiveCounter` (dispatch
level); pipeline sends by wrapping the schedule's point-to-point batch.

Textbook figures (samples/gpt.py: hidden H, microbatch b, sequence S, M microbatches, Ψ parameters on
a rank, N dp ranks, fp32):

- pipeline: every microbatch sends b·S·H activations forward across each boundary and b·S·H
  gradients backward (fxshard also forwards the int targets the loss needs, b·S);
- data parallel (ring collectives; bytes on the wire per rank): ZeRO 0 all-reduces the gradients,
  2(N−1)/N · 4Ψ; ZeRO 1 (the distributed optimizer) and ZeRO 2 reduce-scatter gradients and all-gather
  parameters once, 2(N−1)/N · 4Ψ; ZeRO 3 gathers parameters twice
  (forward and backward), 3(N−1)/N · 4Ψ.  Under a pipeline schedule with M microbatches, FSDP2 gathers
  a stage's parameters before each microbatch's forward and once more for all its backwards (it keeps
  them until the last), (M + 2)(N−1)/N · 4Ψ with the reduce-scatter: the "dp=2 pp=2 zero=3" rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.comm import CollectiveCounter
from benchmarks.common import markdown_table, spawn

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "samples" / "gpt.py"
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: (n - 1), "broadcast": lambda n: (n - 1) / n}  # x input bytes, ring algorithms


class SendCounter:
    """Bytes the pipeline schedule sends, by wrapping its point-to-point batches."""

    def __init__(self):
        self.calls, self.bytes = 0, 0

    def __enter__(self):
        from torch.distributed.pipelining import schedules

        self._module, self._original = schedules, schedules._batch_p2p

        def counted(ops, desc=None):
            for op in ops:
                if op.op is torch.distributed.isend:
                    self.calls += 1
                    self.bytes += op.tensor.numel() * op.tensor.element_size()
            return self._original(ops, desc)

        schedules._batch_p2p = counted
        return self

    def __exit__(self, *exc):
        self._module._batch_p2p = self._original


def _traffic(out: str, steps: int) -> dict:
    from fxshard.train.launch import train
    from fxshard.train.options import RunOptions

    counter, sends = CollectiveCounter(), SendCounter()
    with counter, sends:
        train(Path(out), RunOptions(steps), log=lambda *_: None)
    kinds: dict[str, dict[str, int]] = {}
    for phase in counter.counts.values():
        for kind, v in phase.items():
            e = kinds.setdefault(kind, {"calls": 0, "bytes": 0})
            e["calls"] += v["calls"]
            e["bytes"] += v["bytes"]
    return {"collectives": kinds, "send": {"calls": sends.calls, "bytes": sends.bytes}}


def _worker(rank: int, world: int, outs: dict[str, str]) -> dict:
    found = {}
    for name, out in outs.items():
        one, two = _traffic(out, 1), _traffic(out, 2)
        step = {kind: {k: two["collectives"][kind][k] - one["collectives"].get(kind, {}).get(k, 0)
                       for k in ("calls", "bytes")} for kind in two["collectives"]}
        found[name] = {"collectives": {k: v for k, v in step.items() if v["calls"]},
                       "send": {k: two["send"][k] - one["send"][k] for k in ("calls", "bytes")}}
    return found


def _layouts(dp: int, pp: int):
    from fxshard.ir.context import Layout

    out = {f"pp={pp} 1f1b": Layout(pp=pp)}
    out |= {f"dp={dp} zero={z}": Layout(dp=dp, zero=z) for z in (0, 1, 2, 3)}
    # FSDP2 under a pipeline schedule: a gather per microbatch forward, one for all backwards
    out |= {f"dp={dp} pp={pp} zero=3 m={m}": Layout(dp=dp, pp=pp, zero=3, microbatches=m) for m in (2, 4)}
    return out


def run(workdir: Path, dp: int = 2, pp: int = 2, log=print) -> dict:
    from fxshard.cost.costs import plan_costs
    from fxshard.driver import compile as compile_model

    rows = []
    for name, layout in _layouts(dp, pp).items():
        out = workdir / f"axes-{name.replace(' ', '-').replace('=', '')}"
        result = compile_model(MODEL, layout, out=out)
        log(f"traffic: {name}")
        measured = spawn(_worker, layout.world_size, {name: str(out)})[0][name]  # rank 0's view
        stated = plan_costs(MODEL, layout).ranks[0]
        entry = result.manifest.ranks[0]
        psi = sum(torch.Size(t.shape).numel() for t in entry.tensors.values() if t.kind == "parameter")
        row = {"layout": name, "measured": measured, "psi": psi}
        if layout.pp > 1 and layout.dp == 1:
            m, (b, s) = result.manifest.pipeline.microbatches, result.manifest.inputs[0].microbatch_shape
            hidden = 64  # samples/gpt.py
            row["expected_bytes"] = m * (b * s * hidden * 4 + b * s * 8)  # stage 0 sends activations + targets
            row["measured_bytes"] = measured["send"]["bytes"]
            row["stated_bytes"] = stated["pp_send"].value * 4 - m * b * s * 4 + m * b * s * 8  # targets are int64
        else:
            # the kinds of the ZeRO stage's recipe; the 8-byte loss all-reduce is not model traffic, nor
            # (with pp) the all-reduce summing the tied embedding's gradient between stages (pp axis)
            recipe = {"all_reduce"} if layout.zero == 0 else {"all_gather", "reduce_scatter"}
            wire = sum(WIRE[k](dp) * v["bytes"] for k, v in measured["collectives"].items() if k in recipe
                       and v["bytes"] > 64)
            row["measured_bytes"] = wire
            m = result.manifest.pipeline.microbatches if layout.pp > 1 else 1
            # passes of 4Ψ bytes: ZeRO 0 all-reduce 2, ZeRO 1 and 2 reduce-scatter + gather 2, ZeRO 3
            # reduce-scatter + a gather per microbatch forward + one for the backwards
            row["expected_bytes"] = {0: 2, 1: 2, 2: 2, 3: m + 2}[layout.zero] * (dp - 1) / dp * 4 * psi
            row["stated_bytes"] = stated["dp_bytes"].value
        rows.append(row)
    return {"model": str(MODEL.relative_to(ROOT)), "rows": rows}


def markdown(result: dict) -> str:
    from benchmarks.comm import describe

    rows = []
    for r in result["rows"]:
        what = (f"{r['measured']['send']['calls']} sends" if r["layout"].startswith("pp")
                else describe({"step": r["measured"]["collectives"]}, "step"))
        rows.append([r["layout"], what, f"{r['measured_bytes'] / 1e6:.3f}", f"{r['expected_bytes'] / 1e6:.3f}",
                     f"{r['stated_bytes'] / 1e6:.3f}", f"**{r['measured_bytes'] / r['expected_bytes']:.3f}**"])
    head = (f"{result['model']}, rank 0, one training step (2 steps minus 1 step). pp: bytes stage 0 sends "
            "(activations + int targets; the textbook counts b·S·H per microbatch per boundary); dp: bytes on the "
            "wire per rank for ring collectives (each collective's input bytes × 2(N−1)/N for all-reduce, (N−1)/N "
            "for reduce-scatter and broadcast, (N−1) for all-gather's shard). Stated = `fxshard plan` before "
            "running.")
    return head + "\n\n" + markdown_table(["layout", "measured collectives", "measured MB", "textbook MB",
                                           "fxshard plan MB", "measured ÷ textbook"], rows)
