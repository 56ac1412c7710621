"""`make demo`: compile samples/gpt.py at tp=2, show generated code, train 3 steps on 2 processes,
and print the losses next to single-device training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from fxshard.capture.modelfile import load_model_file
from fxshard.train.reference import reference_losses

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out" / "demo-gpt-tp2"
MODEL = ROOT / "samples" / "gpt.py"
STEPS = 3
console = Console()
fxshard = [sys.executable, "-m", "fxshard.cli.app"]

console.rule("1. compile samples/gpt.py --tp 2")
subprocess.run([*fxshard, "compile", str(MODEL), "--tp", "2", "--out", str(OUT)], check=True)

console.rule("2. an excerpt of rank 1's generated code: the MLP of the class every block runs")
code = (OUT / "rank_pp0_tp1.py").read_text().splitlines()
block = next(i for i, line in enumerate(code) if line.startswith("class Block("))
start = next(i for i, line in enumerate(code) if i > block and line.strip().startswith("# ln_2"))
end = next(i for i, line in enumerate(code) if i > start and line.strip().startswith("return "))
console.print(Syntax("\n".join(code[start:end]), "python", line_numbers=True, start_line=start + 1,
                     word_wrap=True))
console.print(f"(whole file: {OUT / 'rank_pp0_tp1.py'}; `fxshard show {OUT} --rank 1`)")

console.rule(f"3. train {STEPS} steps on 2 processes (gloo)")
metrics = OUT / "metrics.jsonl"
subprocess.run([*fxshard, "run", str(OUT), "--steps", str(STEPS), "--metrics", str(metrics)], check=True)
dist = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

console.rule("4. the same training on one device")
single = reference_losses(load_model_file(MODEL), STEPS)
table = Table(title="losses: fxshard tp=2 vs single device (AdamW lr 1e-3)")
for col in ("step", "tp=2 (2 processes)", "single device", "relative difference"):
    table.add_column(col, justify="right")
worst = 0.0
for i, (a, b) in enumerate(zip(dist, single, strict=True), start=1):
    rel = abs(a - b) / max(abs(b), 1e-12)
    worst = max(worst, rel)
    table.add_row(str(i), f"{a:.7f}", f"{b:.7f}", f"{rel:.1e}")
console.print(table)
ok = worst <= 1e-5
console.print(f"[bold {'green' if ok else 'red'}]{'match' if ok else 'MISMATCH'}[/]: largest relative difference "
              f"{worst:.1e} (tolerance 1e-5)")
sys.exit(0 if ok else 1)
