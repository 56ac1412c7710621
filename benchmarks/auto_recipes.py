"""The time model against published recipes: fxshard's predicted tokens/s per GPU at each recipe's own layout, next
to the published figure, and fxshard's own choice (``plan --auto``) for the same model, devices and sequence.

    python -m benchmarks.auto_recipes                 # results/auto-recipes.md and .json
    python -m benchmarks.auto_recipes --only llama3-8b

Every figure is a prediction on the shipped ``h100`` profile (datasheet peaks, assumed efficiencies); nothing here
ran on a GPU. Where a recipe's layout uses what fxshard does not have (cp, FP8, torch.compile's fused kernels), the
table says what was predicted instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fxshard.ir.layout import Layout  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MEGATRON = "Megatron-Bridge performance summary (as issue 33 quotes it)"
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str
    gpus: int
    seq: int
    global_batch: int
    layout: Layout  # what fxshard predicts: the recipe's layout, or the nearest fxshard has
    recompute: str  # the recipe's activation checkpointing, as fxshard's mode
    published: float  # tokens/s per GPU
    source: str
    published_layout: str
    notes: str


RECIPES = [
    Recipe("llama3-70b", "samples/llama70b.py", 64, 8192, 128,
           Layout(tp=4, pp=8, dp=2, schedule="interleaved-1f1b", virtual_stages=5, microbatches=64, dtype="bf16",
                  sp=True), "auto", 1664, MEGATRON, "TP4 PP8 VP5, BF16",
           "sequence 8192 and global batch 128 assumed (Megatron-Bridge's Llama 3 70B pretraining defaults); "
           "Megatron runs sequence parallelism with TP"),
    Recipe("llama3.1-405b", "samples/llama405b.py", 1024, 8192, 512,
           Layout(tp=8, pp=8, cp=2, dp=8, schedule="interleaved-1f1b", virtual_stages=8, microbatches=64,
                  dtype="bf16", sp=True), "auto", 326, MEGATRON, "TP8 PP8 CP2 VP8, BF16",
           "cp is costed analytically (the pieces compiled at cp=1, attention against the whole sequence, the keys' "
           "and values' all-gather); sequence 8192, global batch 512 assumed; 126 layers over 64 virtual stages are "
           "uneven (Megatron's recipe drops layers from the first and last)"),
    Recipe("deepseek-v3", "benchmarks/models/deepseek_v3.py", 1024, 4096, 8192,
           Layout(tp=2, pp=8, dp=64, ep=64, microbatches=128, dtype="bf16", sp=True), "auto", 1297, MEGATRON,
           "TP2 PP8 EP64, BF16",
           "sequence 4096 and global batch 8192 assumed; no multi-token-prediction module in transformers' model; "
           "Megatron's grouped GEMM and DeepEP dispatch kernels are not modelled (the all-to-all is a ring formula)"),
    Recipe("llama3-8b", "benchmarks/models/llama3_8b.py", 8, 8192, 16,
           Layout(dp=8, zero=3, dtype="bf16"), "selective", 5762, TITAN, "FSDP 8, BF16, eager, selective AC",
           "local batch 2; torchtitan's H100s are the 96 GB HBM2e parts at 500 W (2.4 TB/s), the profile is the "
           "80 GB SXM at 700 W"),
    Recipe("llama3-70b-titan", "samples/llama70b.py", 256, 8192, 512,
           Layout(tp=8, dp=32, zero=3, dtype="bf16", sp=True), "full", 829, TITAN,
           "FSDP 32 x TP 8, torch.compile + Float8, full AC",
           "published with Float8 linears and torch.compile: fxshard predicts BF16 without them (FP8 doubles the "
           "matmul peak); local batch 16"),
]


def run(names: list[str] | None = None, top: int = 3) -> list[dict]:
    from fxshard.cost.hardware import load_hardware
    from fxshard.cost.profile import model_profile
    from fxshard.cost.search import Candidate, _least_recompute, search
    from fxshard.cost.timemodel import Evaluator, Setting, predict

    hw = load_hardware("h100")
    rows, profiles = [], {}
    for recipe in RECIPES:
        if names and recipe.name not in names:
            continue
        started = time.perf_counter()
        if recipe.model not in profiles:
            profiles[recipe.model] = model_profile(ROOT / recipe.model, dtype="bf16")
        profile = profiles[recipe.model]
        captured = time.perf_counter() - started
        ev = Evaluator(profile, hw, "bf16")
        setting = Setting(recipe.seq, recipe.global_batch, 8)
        layout = recipe.layout
        if recipe.recompute == "auto":  # the least recompute that fits, as the search does
            fit, _ = _least_recompute(ev, Candidate(layout), setting)
            layout = fit.layout if fit else replace(layout, recompute="full")
        else:
            layout = replace(layout, recompute=recipe.recompute)
        at_recipe = predict(ev, layout, setting)
        started = time.perf_counter()
        try:
            found = search(profile, hw, recipe.gpus, setting, "bf16", top=top, evaluator=ev)
            best, searched = found.ranked[0], {"seconds": found.seconds, "cpu_seconds": found.cpu_seconds,
                                               "considered": found.considered, "fitting": found.fitting}
        except Exception as e:  # a refusal is a result too
            best, searched = None, {"seconds": time.perf_counter() - started, "error": str(e)}
        rows.append({"recipe": recipe.name, "model": recipe.model, "gpus": recipe.gpus, "seq": recipe.seq,
                     "global_batch": recipe.global_batch, "source": recipe.source,
                     "published_layout": recipe.published_layout, "published": recipe.published,
                     "predicted_layout": layout.describe(), "predicted": at_recipe.tokens_per_s,
                     "ratio": at_recipe.tokens_per_s / recipe.published, "mfu": at_recipe.mfu,
                     "fits": at_recipe.fits, "peak": at_recipe.peak, "terms": at_recipe.terms,
                     "auto_layout": best.layout.describe() if best else None,
                     "auto_predicted": best.tokens_per_s if best else None, "auto_accumulate": best.accumulate if best else None,
                     "search": searched, "capture_s": captured, "notes": recipe.notes})
        print(f"{recipe.name}: predicted {at_recipe.tokens_per_s:,.0f} tok/s/GPU vs published {recipe.published:,} "
              f"({at_recipe.tokens_per_s / recipe.published:.2f}); auto {rows[-1]['auto_layout']} "
              f"({searched['seconds']:.0f} s)", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| recipe | GPUs | seq | published layout | published tok/s/GPU | fxshard predicts at | predicted tok/s/GPU | "
             "ratio | MFU | fits 80 GB | fxshard's own choice | its prediction | search time |",
             "|---|---:|---:|---|---:|---|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        auto = r["auto_layout"] or f"refused: {r['search'].get('error', '')[:120]}"
        if r["auto_layout"] and r["auto_accumulate"] and r["auto_accumulate"] > 1:
            auto += f" grad-accum={r['auto_accumulate']}"
        lines.append(f"| {r['recipe']} | {r['gpus']} | {r['seq']} | {r['published_layout']} | {r['published']:,} | "
                     f"{r['predicted_layout']} | {r['predicted']:,.0f} | {r['ratio']:.2f} | {r['mfu']:.0%} | "
                     f"{'yes' if r['fits'] else 'no'} ({r['peak'] / 2**30:.0f} GiB) | {auto} | "
                     + (f"{r['auto_predicted']:,.0f}" if r["auto_predicted"] else "-")
                     + f" | {r['search']['seconds']:.0f} s"
                     + (f" ({r['search']['cpu_seconds']:.0f} s CPU)" if "cpu_seconds" in r["search"] else "") + " |")
    lines += ["", "Where each misses, and why:", ""]
    lines += [f"- **{r['recipe']}** ({r['source']}): {r['notes']}." for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_recipes", description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=[r.name for r in RECIPES])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = run(args.only)
    name = "auto-recipes" if not args.only else "auto-recipes-" + "-".join(args.only)
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    head = ("`python -m benchmarks.auto_recipes`: fxshard's time model on the shipped h100 profile (predictions "
            "only, no GPU ran), against published throughput.\n\n")
    (args.out / f"{name}.md").write_text(head + markdown(rows) + "\n")


if __name__ == "__main__":
    main()
