"""What ``fxshard plan --auto`` and ``fxshard plan --hardware`` print: the time model's figures, the ranked layouts."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fxshard.units import human_bytes


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def time_lines(console: Console, pred, hw, setting) -> None:
    """The time model's figures of one prediction, one line each."""
    exposed = sum(pred.exposed.values())
    by_axis = ", ".join(f"{axis} {_ms(t)}" for axis, t in pred.exposed.items() if t > 0) or "none"
    console.print(f"time model on {hw.name} ({setting.gpus_per_node} per node), sequence {setting.seq}, global "
                  f"batch {setting.global_batch}, {pred.microbatches} microbatch(es) of {pred.rows} row(s) per dp rank",
                  highlight=False)
    console.print(f"  compute (forward, backward, recompute) {_ms(pred.compute)};  exposed communication "
                  f"{_ms(exposed)} ({by_axis});  pipeline bubble {_ms(pred.bubble)}"
                  f"{f' (stage imbalance {_ms(pred.imbalance)})' if pred.imbalance else ''};  optimizer step "
                  f"{_ms(pred.terms.get('optimizer step', 0.0))}", highlight=False)
    console.print(f"  predicted step {_ms(pred.step)};  {pred.tokens_per_s:,.0f} tokens/s per device;  MFU "
                  f"{pred.mfu:.1%};  predicted peak {human_bytes(pred.peak)} of {human_bytes(pred.memory)} "
                  f"({'fits' if pred.fits else 'does not fit'})", highlight=False)


def auto_report(console: Console, found, command: str) -> None:
    """The best layouts, why each loses to the first, and the command that compiles the winner."""
    from fxshard.cost.search import explain

    result, hw = found.result, found.hardware
    best = result.ranked[0]
    table = Table(title=f"fxshard plan --auto: {found.model} on {result.gpus} x {hw.name}")
    for column in ("#", "layout", "step", "tokens/s/device", "MFU", "peak", "why slower than #1"):
        table.add_column(column,
                         justify="right" if column in ("#", "step", "tokens/s/device", "MFU", "peak") else "left")
    for i, p in enumerate(result.ranked, 1):
        accumulate = f" grad-accum={p.accumulate}" if p.layout.pp == 1 and p.accumulate > 1 else ""
        table.add_row(str(i), p.layout.describe() + accumulate, _ms(p.step), f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}",
                      human_bytes(p.peak), explain(best, p))
    console.print(table)
    time_lines(console, best, hw, result.setting)
    console.print(f"searched {result.considered} layouts that divide, {result.fitting} fit, {result.simulated} "
                  f"pipelines simulated: {result.seconds:.1f} s search + {found.capture_seconds:.1f} s capture",
                  highlight=False)
    for note in ([found.dtype_note] if getattr(found, "dtype_note", "") else []) + result.notes + found.profile.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(f"compile it: {command}", highlight=False, soft_wrap=True)
