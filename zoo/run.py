"""The model zoo: every architecture of ``zoo/models`` under tp=2, pp=2, dp=2, tp=2 with sequence parallelism
(``tp=2,sp``) and tp=2 x pp=2 (``tp=2,pp=2``), each compared with
single-device training by ``fxshard verify`` (3 AdamW steps; losses within 1e-5 relative, trained parameters
within 1e-3 of the update), in its own process with a time limit so one case cannot stall the matrix.

    python -m zoo.run                      # the whole matrix -> zoo/RESULTS.md
    python -m zoo.run --only llama t5      # some architectures (or --only llama,t5)
    python -m zoo.run --only mamba2 --layouts tp=2 tp=2,pp=2 --out /tmp/zoo.md   # some layouts
    python -m zoo.run --jobs 2             # two cases at once (the page is rewritten after every case)
    python -m zoo.run --jobs 2 --resume    # a run cut short: measure only the cases its page does not hold yet
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MODELS = ROOT / "models"
LAYOUTS = {"tp=2": ["--tp", "2"], "pp=2": ["--pp", "2"], "dp=2": ["--dp", "2"], "tp=2,sp": ["--tp", "2", "--sp"],
           "tp=2,pp=2": ["--tp", "2", "--pp", "2"]}
LIMIT_S = 600


def run_case(model: Path, flags: list[str]) -> tuple[str, str]:
    """``(verdict, detail)``: exact / refused / FAILED, with the figures or the reason."""
    try:
        # workers forked from the launcher, as the tests run them (docs/testing.md): half the CPU of a case
        env = {**os.environ, "FXSHARD_WORKERS": os.environ.get("FXSHARD_WORKERS", "fork")}
        proc = subprocess.run([sys.executable, "-m", "fxshard.cli.app", "verify", str(model), *flags],
                              capture_output=True, text=True, timeout=LIMIT_S, env=env)
    except subprocess.TimeoutExpired:
        return "FAILED", f"no verdict within {LIMIT_S} s"
    text = " ".join((proc.stdout + proc.stderr).split())
    found = re.search(r"losses max abs \S+ rel (\S+); parameters max abs \S+, "
                      r"\|\|diff\|\| / \|\|update\|\| (\S+)", text)
    quiet = re.search(r"and (\d+) quiet parameters .*? max abs (\S+) within (\S+),", text)
    figures = f"loss {found[1]}, params {found[2]}" + (f", {quiet[1]} quiet {quiet[2]} within {quiet[3]}" if quiet
                                                       else "") if found else ""
    if proc.returncode == 0 and found and " ".join(proc.stdout.split()).endswith(": OK"):
        return "exact", figures
    if found:
        return "FAILED", figures
    error = re.search(r"error: (.*)", proc.stderr)
    reason = error[1] if error else (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if not error or error[1].startswith("distributed run failed"):  # a compiled program that fails: not a refusal
        ranks = re.findall(r"rank \d+ exited with code \d+: (.*)", proc.stderr)
        return "FAILED", f"{reason} {ranks[0]}" if ranks else reason
    return "refused", reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="architectures (file names without .py; spaces or commas between)")
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), help="layouts (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (each its own processes)")
    parser.add_argument("--out", type=Path, default=ROOT / "RESULTS.md")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cells the page at --out holds and measure only the rest (its minutes add up)")
    args = parser.parse_args(argv)
    layouts = {name: flags for name, flags in LAYOUTS.items() if not args.layouts or name in args.layouts}
    only = {name for names in args.only or () for name in names.split(",") if name}
    unknown = sorted(only - {p.stem for p in MODELS.glob("*.py")})
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such architecture in {MODELS} (a file name without .py)")
    models = sorted(p for p in MODELS.glob("*.py") if not only or p.stem in only)
    results, before = read_page(args.out) if args.resume and args.out.exists() else ({}, 0.0)
    cases = [(model, name) for model in models for name in layouts if (model.stem, name) not in results]
    columns = tuple(name for name in LAYOUTS if name in layouts or any(n == name for _, n in results))
    total = len(results) + len(cases)
    if results:
        print(f"{args.out}: {len(results)} cases kept, {len(cases)} to measure", flush=True)
    start = time.monotonic()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # threads: each case is a subprocess
        running = {pool.submit(run_case, model, layouts[name]): (model, name) for model, name in cases}
        for future in as_completed(running):
            model, name = running[future]
            verdict, detail = results[model.stem, name] = future.result()
            print(f"{model.stem:12s} {name}: {verdict} ({detail})", flush=True)
            # the page so far after every case, so a run cut short still leaves what it measured
            minutes = before + (time.monotonic() - start) / 60
            count = len({arch for arch, _ in results} | {m.stem for m in models})
            args.out.write_text(results_page(results, count, minutes, columns, total))
    print(f"wrote {args.out}")
    return 0 if all(verdict != "FAILED" for verdict, _ in results.values()) else 1


def read_page(path: Path) -> tuple[dict[tuple[str, str], tuple[str, str]], float]:
    """The cells of a page :func:`results_page` wrote, as ``{(arch, layout): (verdict, detail)}`` (cells ``not run
    yet`` left out), and its minutes: what ``--resume`` keeps."""
    text = path.read_text().partition("\n## ")[0]  # the run's own table and notes (sections after are older runs')
    notes = dict(re.findall(r"^(\d+)\. (.*)$", text.partition("\nRefusals")[2], re.M))
    table = text[text.find("\n| architecture |"):].split("\n\n")[0]
    rows = [line.strip().strip("|").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    if not rows or rows[0][0].strip() != "architecture":
        return {}, 0.0
    layouts, results = [c.strip() for c in rows[0][1:]], {}
    for arch, *cells in rows[1:]:
        for layout, cell in zip(layouts, (c.strip() for c in cells), strict=True):
            refused = re.fullmatch(r"refused \[(\d+)\]", cell)
            if refused:
                results[arch.strip(), layout] = ("refused", notes[refused[1]])
            elif cell != "not run yet":
                verdict, _, detail = cell.partition(": ")
                results[arch.strip(), layout] = (verdict, detail)
    minutes = re.search(r"in (\d+) min", text)
    return results, float(minutes[1]) if minutes else 0.0


def results_page(results: dict[tuple[str, str], tuple[str, str]], count: int, minutes: float,
                 layouts: tuple[str, ...] = tuple(LAYOUTS), total: int | None = None) -> str:
    """The table (architecture x layout), each refusal's reason once, as a numbered note under the table."""
    reasons: list[str] = []
    rows = []
    for arch in sorted({a for a, _ in results}):
        cells = []
        for layout in layouts:
            verdict, detail = results.get((arch, layout), ("not run yet", ""))
            if verdict == "refused":
                if detail not in reasons:
                    reasons.append(detail)
                cells.append(f"refused [{reasons.index(detail) + 1}]")
            else:
                cells.append(f"{verdict}: {detail}" if detail else verdict)
        rows.append(f"| {arch} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    table = ["| architecture | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts), *rows]
    notes = [f"{i}. {reason}" for i, reason in enumerate(reasons, 1)]
    return ("# Model zoo\n\n`make zoo` (`python -m zoo.run`): each architecture of `zoo/models` trained 3 AdamW "
            "steps under each layout and compared with single-device training by `fxshard verify` (losses "
            "relative, trained parameters as a share of the update; tolerances 1e-5 and 1e-3). "
            f"{count} architectures in {minutes:.0f} min on this machine"
            + (f" (a run in progress: {len(results)} of {total} cases so far)" if total and len(results) < total
               else "")
            + ".\n\n" + "\n".join(table) + "\n"
            + ("\nRefusals (the compile's own message):\n\n" + "\n".join(notes) + "\n" if notes else ""))


if __name__ == "__main__":
    sys.exit(main())
