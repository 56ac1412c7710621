"""Every layout against one device: ``fxshard verify`` case by case, on NCCL with every rank on one GPU, or on gloo.

    python scripts/nccl_matrix.py --device cuda --out out/matrix    # the GPU run (scripts/gpu_check.sh matrix)
    python scripts/nccl_matrix.py --device cpu --out out/matrix     # the rehearsal on the CPU, gloo
    python scripts/nccl_matrix.py --only llama-tp2 --only mixtral-dp2-ep2

Each case is ``fxshard verify MODEL <flags>`` in a process of its own with its own time limit: the rank files
trained on ``world`` local processes and compared with the unmodified model trained on one device (the CPU), losses
and trained parameters, each at verify's tolerance (bf16's under ``--dtype bf16``: fxshard/check/verify.py).  On
``--device cuda`` the ranks all train on the one GPU: ``FXSHARD_SHARE_GPU=1`` lets them
(:mod:`fxshard.train.device`; each rank its own ``NCCL_HOSTID``), and ``scripts/gpu_check.sh`` starts MPS first so
their kernels run side by side.  On ``--device cpu`` the GPU is hidden (``CUDA_VISIBLE_DEVICES=``) and they are gloo
processes.  The ``--weights`` case saves a Hugging Face folder and verifies a model compiled from it
(``verify(weights=...)``: each rank reads its slices at run time).  A case whose layout option does not exist yet
is listed as not built (``NEEDS_FIELD``).

It writes ``OUT/nccl-matrix.log`` (every case's whole output, in order) and ``OUT/nccl-matrix.md`` (one row per
case; ``gloo-matrix.*`` on the CPU), and prints the table last; it exits 1 when a case failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA, MIXTRAL = ROOT / "samples" / "llama.py", ROOT / "tests" / "models" / "hf_mixtral.py"
QWEN3_MOE = ROOT / "tests" / "models" / "hf_qwen3_moe.py"
STEPS = 3

# name -> (model file, flags of fxshard verify); the order is the log's.  Issue 34's list, and one --weights load.
CASES: dict[str, tuple[Path | None, list[str]]] = {
    "llama-tp2-compile": (LLAMA, ["--tp", "2", "--compile"]),  # first: the longest (inductor's compile)
    "llama-tp2-pp2-dp2-zero1": (LLAMA, ["--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1"]),
    "llama-tp2": (LLAMA, ["--tp", "2"]),
    "llama-pp2-1f1b": (LLAMA, ["--pp", "2", "--schedule", "1f1b"]),
    "llama-pp2-interleaved": (LLAMA, ["--pp", "2", "--schedule", "interleaved-1f1b"]),
    "llama-dp2-zero1": (LLAMA, ["--dp", "2", "--zero", "1"]),
    "llama-dp2-zero2": (LLAMA, ["--dp", "2", "--zero", "2"]),
    "llama-dp2-zero3": (LLAMA, ["--dp", "2", "--zero", "3"]),
    "llama-tp2-sp": (LLAMA, ["--tp", "2", "--sp"]),
    "llama-tp2-recompute-selective": (LLAMA, ["--tp", "2", "--recompute", "selective"]),
    "llama-tp2-dp2-bf16": (LLAMA, ["--tp", "2", "--dp", "2", "--dtype", "bf16"]),
    "mixtral-dp2-ep2": (MIXTRAL, ["--dp", "2", "--ep", "2"]),
    "qwen3moe-dp2-ep2": (QWEN3_MOE, ["--dp", "2", "--ep", "2"]),  # another expert layout, as transformers writes it
    "llama-cp2": (LLAMA, ["--cp", "2"]),  # context parallelism (docs/context-parallel.md): allgather K/V
    "llama-cp2-ring": (LLAMA, ["--cp", "2", "--cp-mode", "ring"]),  # send/recv around the cp ring
    "llama-cp2-tp2-a2a": (LLAMA, ["--cp", "2", "--tp", "2", "--cp-mode", "a2a"]),  # Ulysses all-to-alls
    # float8 products (torch._scaled_mm: compute capability 8.9+), the same recipe on one device (docs/fp8.md): the
    # amaxes all-reduced over tp, and over cp x tp with the fused sp linears
    "llama-tp2-sp-fp8": (LLAMA, ["--tp", "2", "--sp", "--fp8", "tensorwise"]),
    "llama-cp2-tp2-sp-fp8": (LLAMA, ["--cp", "2", "--tp", "2", "--sp", "--fp8", "tensorwise"]),
    "llama-tp2-weights": (None, ["--tp", "2"]),  # a Hugging Face folder, --weights: see _weights_case
}
NEEDS_FIELD: dict[str, str] = {}  # a case that waits for a Layout field (none now: --cp has landed)
LIMIT_S = {"llama-tp2-compile": 240, "llama-tp2-pp2-dp2-zero1": 200}  # on a GPU machine's 16 cores
DEFAULT_LIMIT_S = 150
CPU_SLOWER = 4  # the limits' factor on --device cpu: a rehearsal on 2 shared cores runs 8 ranks and inductor there
SUMMARY = re.compile(r"losses max abs (\S+) rel (\S+); parameters max abs (\S+), \|\|diff\|\| / \|\|update\|\|\s+(\S+) "
                     r"\(most: (\S+)\); tolerance: losses (\S+) relative, parameters (\S+) of\s+the "
                     r"update[^:]*:\s+(OK|FAILED)")


def built(case: str) -> bool:
    from fxshard.ir.context import Layout

    need = NEEDS_FIELD.get(case)
    return need is None or need in {f.name for f in dataclasses.fields(Layout)}


def command(case: str, work: Path) -> list[str]:
    model, flags = CASES[case]
    if model is None:  # the --weights load: this script's own entry point (fxshard verify has no --weights)
        return [sys.executable, __file__, "--weights-case", str(work / case), *flags]
    return [sys.executable, "-m", "fxshard.cli.app", "verify", str(model), *flags, "--steps", str(STEPS),
            "--out", str(work / case)]


def run_case(case: str, work: Path, env: dict, slower: int = 1) -> dict:
    """One case in its own process: its output, exit status, seconds and the agreement figures it printed."""
    start = time.monotonic()
    limit = LIMIT_S.get(case, DEFAULT_LIMIT_S) * slower
    try:
        done = subprocess.run(command(case, work), env=env, capture_output=True, text=True, timeout=limit)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n(stopped after its {limit} s limit)"
        code = None
    row = {"case": case, "exit": code, "seconds": round(time.monotonic() - start, 1), "output": output}
    found = SUMMARY.search(" ".join(output.split()))  # rich wraps the summary line at 120 columns
    if found:
        names = ("loss_abs", "loss_rel", "param_abs", "param_share", "most", "loss_tol", "param_tol", "verdict")
        row |= dict(zip(names, found.groups(), strict=True))
    return row


def status(row: dict) -> str:
    if row.get("exit") is None:
        return "timed out"
    if row["exit"] == 0 and row.get("verdict") == "OK":
        return "pass"
    return "FAILED" if row.get("verdict") == "FAILED" else f"error (exit {row['exit']})"


def markdown(rows: list[dict], device: str, seconds: float) -> str:
    lines = [f"`python scripts/nccl_matrix.py --device {device}`: {STEPS} steps of each layout against one device "
             f"(the CPU), {seconds:.0f} s in all.",
             "", "| case | flags | result | s | losses: max rel diff (tolerance) | parameters: ‖diff‖ / ‖update‖ "
             "(tolerance) | differs most |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        flags = " ".join(CASES[row["case"]][1]) + (" --weights" if CASES[row["case"]][0] is None else "")
        if row.get("skipped"):
            lines.append(f"| {row['case']} | `{flags}` | not built ({row['skipped']}) | — | — | — | — |")
            continue
        loss = f"{row['loss_rel']} ({row['loss_tol']})" if "loss_rel" in row else "—"
        param = f"{row['param_share']} ({row['param_tol']})" if "param_share" in row else "—"
        lines.append(f"| {row['case']} | `{flags}` | {status(row)} | {row['seconds']} | {loss} | {param} | "
                     f"{row.get('most', '—')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--only", action="append", choices=list(CASES), help="run this case only (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "matrix")
    parser.add_argument("--weights-case", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.weights_case is not None:
        return _weights_case(args.weights_case, rest)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU
    else:
        env["FXSHARD_SHARE_GPU"] = "1"  # every rank on the one GPU (fxshard.train.device)
    cases = [c for c in CASES if c in (args.only or CASES)]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fxshard-matrix-") as work:
        todo = [c for c in cases if built(c)]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            slower = CPU_SLOWER if args.device == "cpu" else 1
            done = dict(zip(todo, pool.map(lambda c: run_case(c, Path(work), env, slower), todo), strict=True))
    rows = [done.get(c) or {"case": c, "skipped": f"no Layout.{NEEDS_FIELD[c]} yet"} for c in cases]
    seconds = time.monotonic() - start
    name = {"cuda": "nccl", "cpu": "gloo"}[args.device] + "-matrix"
    with open(args.out / f"{name}.log", "w") as log:
        for row in rows:
            if not row.get("skipped"):
                log.write(f"===== {row['case']}: {status(row)} after {row['seconds']} s\n$ "
                          f"{' '.join(command(row['case'], Path('WORK')))}\n{row['output']}\n")
    table = markdown(rows, args.device, seconds)
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)
    return 0 if all(r.get("skipped") or status(r) == "pass" for r in rows) else 1


def _weights_case(work: Path, flags: list[str]) -> int:
    """The ``--weights`` case: samples/llama.py's configuration saved as a Hugging Face folder (seed 3, not the
    weights make_model() would draw), a model file built from that folder's config, verified with the folder as
    ``--weights``; its report printed as ``fxshard verify`` prints it."""
    import torch
    from fxshard.cli.report import verify_report
    from rich.console import Console
    from transformers import LlamaForCausalLM

    from fxshard.capture.modelfile import load_model_file
    from fxshard.driver import verify
    from fxshard.ir.context import Layout

    work.mkdir(parents=True, exist_ok=True)
    folder = work / "llama-hub"
    torch.manual_seed(3)
    LlamaForCausalLM(load_model_file(LLAMA).module.config()).save_pretrained(folder)
    model_file = work / "llama_from_folder.py"
    model_file.write_text(
        "import torch\nfrom transformers import AutoConfig, AutoModelForCausalLM\n\n\n"
        f"def make_model():\n    return "
        f"AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({str(folder)!r}))\n\n\n"
        "def make_inputs():\n    ids = torch.randint(0, 256, (4, 16))\n"
        "    return {'input_ids': ids, 'labels': ids.clone(), 'use_cache': False}\n")
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    layout = Layout(tp=tp)
    print(f"verifying {model_file} at {layout.describe()} --weights {folder}: {STEPS} steps distributed and on one "
          "device", flush=True)
    result = verify(model_file, layout, STEPS, out=work / "out", weights=folder)
    verify_report(Console(width=120), result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
