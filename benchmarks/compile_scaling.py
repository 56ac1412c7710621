"""Compile time and memory of a 70B-shaped Llama on meta tensors, from 2 to 80 layers.

Each layer count is compiled in a fresh Python process (``python -m benchmarks.compile_scaling
LAYERS TP PP``) and its peak resident memory is read from ``VmHWM`` in ``/proc/self/status``, the
high-water mark of this process's own address space (``ru_maxrss`` is not: Linux carries the parent's
peak across fork and exec, so a child of the big benchmark process reported the parent's): capture with torch.export,
the passes, code generation and the static checks, at ``tp=8 pp=4`` (``pp=2`` for 2 layers: a stage
needs a block), with no weights (``fxshard.compile(..., meta=True)``).  Reported per layer count:
wall seconds, peak RSS, seconds per layer, and the growth ratio ``time(80) / time(8)`` next to 10,
the ratio of linear growth.  The model is ``LlamaForCausalLM`` with Llama-3-70B's shape: hidden
8192, intermediate 28672, 64 heads, 8 key/value heads, vocabulary 128256.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import markdown_table

LAYERS = (2, 4, 8, 16, 32, 80)
QUICK_LAYERS = (4, 8)
MODEL = '''"""Llama-3-70B-shaped LlamaForCausalLM with {layers} layers (benchmarks/compile_scaling.py)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers={layers},
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, 128256, (8, 32))
    return {{"input_ids": ids, "labels": ids.clone(), "use_cache": False}}
'''


def model_file(folder: Path, layers: int) -> Path:
    path = folder / f"llama70b_{layers}.py"
    path.write_text(MODEL.format(layers=layers))
    return path


def measure(layers: int, tp: int, pp: int, folder: Path) -> dict:
    """Compile in this process (meant to be a fresh one); wall seconds and peak RSS."""
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    path = model_file(folder, layers)
    start = time.perf_counter()
    result = compile_model(path, Layout(tp=tp, pp=pp), out=folder / f"out{layers}", meta=True)
    seconds = time.perf_counter() - start
    peak_mb = _vm_hwm_kib() / 1024
    return {"layers": layers, "tp": tp, "pp": pp, "seconds": round(seconds, 2), "peak_rss_mb": round(peak_mb),
            "rank_files": len(result.files)}


def _vm_hwm_kib() -> int:
    """Peak resident set of this address space, in KiB (Linux); ``ru_maxrss`` where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run(work: Path, quick: bool = False) -> dict:
    """Compile every layer count in its own process; the rows and the growth ratio."""
    rows = []
    for layers in QUICK_LAYERS if quick else LAYERS:
        folder = work / f"compile{layers}"
        folder.mkdir(parents=True, exist_ok=True)
        pp = 4 if layers >= 4 else 2
        done = subprocess.run([sys.executable, "-m", "benchmarks.compile_scaling", str(layers), "8", str(pp),
                               str(folder)], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {layers} layers failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["seconds_per_layer"] = round(row["seconds"] / layers, 3)
        rows.append(row)
    by = {r["layers"]: r for r in rows}
    lo, hi = (4, 8) if quick else (8, 80)
    growth = {"from": lo, "to": hi, "time_ratio": round(by[hi]["seconds"] / by[lo]["seconds"], 2),
              "rss_ratio": round(by[hi]["peak_rss_mb"] / by[lo]["peak_rss_mb"], 2), "linear": hi / lo,
              # the cost of one more layer, free of the fixed cost (imports, embedding, head, 32 files)
              "marginal_s_per_layer": round((by[hi]["seconds"] - by[lo]["seconds"]) / (hi - lo), 3),
              "marginal_mb_per_layer": round((by[hi]["peak_rss_mb"] - by[lo]["peak_rss_mb"]) / (hi - lo), 2)}
    return {"rows": rows, "growth": growth}


def markdown(result: dict) -> str:
    rows = [[r["layers"], f"tp={r['tp']} pp={r['pp']}", f"{r['seconds']:.1f}", f"{r['seconds_per_layer']:.2f}",
             r["peak_rss_mb"]] for r in result["rows"]]
    g = result["growth"]
    table = markdown_table(["layers", "layout", "compile s", "s / layer", "peak RSS MB"], rows)
    return (f"{table}\n\nGrowth from {g['from']} to {g['to']} layers: time x{g['time_ratio']}, peak RSS "
            f"x{g['rss_ratio']} (linear growth: x{g['linear']:g}); each further layer costs "
            f"{g['marginal_s_per_layer']:.2f} s and {g['marginal_mb_per_layer']:.1f} MB.")


if __name__ == "__main__":
    layers, tp, pp, folder = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    print(json.dumps(measure(layers, tp, pp, folder)))
