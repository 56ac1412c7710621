"""Model-state bytes per rank under each ZeRO stage and precision, next to the ZeRO formulas.

Reuses ``fxshard run --memory-report``'s measurement (:mod:`fxshard.train.memory`): every (dtype, zero) of
samples/gpt.py is compiled at dp = N and trained one step on N gloo processes; each rank walks the
distinct storages behind its parameters, gradients and optimizer state.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import markdown_table, spawn

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "samples" / "gpt.py"
MIB = 2**20


def run(dp: int, workdir: Path, log=print) -> dict:
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout
    from fxshard.testing import measure_on_rank
    from fxshard.train.memory import report_rows

    layouts, outs = {}, {}
    for dtype in ("fp32", "bf16"):
        for zero in (0, 1, 2, 3):
            name = f"{dtype}-zero{zero}"
            layouts[name] = Layout(dp=dp, zero=zero, dtype=dtype)
            outs[name] = str(workdir / f"memory-{name}")
            compile_model(MODEL, layouts[name], out=outs[name])
    log(f"memory: {len(outs)} layouts at dp={dp}")
    per_rank = spawn(measure_on_rank, dp, outs)
    rows = []
    for name, layout in layouts.items():
        r = report_rows([p[name] for p in per_rank], layout)[0]  # every dp rank holds the same amount
        rows.append({"dtype": layout.dtype, "zero": layout.zero, "formula": r["formula_text"], "psi": r["psi"],
                     **{k: r[k] for k in ("params", "grads", "optimizer", "total", "gathered")},
                     "formula_total": r["formula"]["total"], "ratio": round(r["ratio"], 4), "note": r["note"]})
    return {"model": str(MODEL.relative_to(ROOT)), "dp": dp, "rows": rows}


def markdown(result: dict) -> str:
    rows = [[r["dtype"], r["zero"], r["formula"], *(f"{r[k] / MIB:.2f}" for k in ("params", "grads", "optimizer",
                                                                                  "total", "formula_total")),
             f"**{r['ratio']:.3f}**", f"{r['gathered'] / MIB:.2f}"] for r in result["rows"]]
    notes = [f"{r['dtype']} ZeRO 2: {r['note']}" for r in result["rows"] if r["note"]]
    head = (f"{result['model']} (Ψ = {result['rows'][0]['psi']:,} parameters) at dp = {result['dp']}, one step, "
            "MiB per rank, measured by `fxshard run --memory-report`'s walk over the storages a rank holds.")
    table = markdown_table(["dtype", "zero", "formula", "params", "grads", "optimizer", "total", "formula total",
                            "measured ÷ formula", "params held during forward"], rows)
    return "\n\n".join([head, table, *notes])
