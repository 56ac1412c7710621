"""The time and memory model against published runs: at each recipe's own layout, precision and recompute
(:mod:`benchmarks.recipes`, every figure cited), fxshard's predicted tokens/s per GPU beside the published one,
each term of the predicted step, each rank's predicted memory beside Megatron's theoretical formula
(:mod:`benchmarks.megatron_memory`) or the memory the publication measured, and fxshard's own choice
(``plan --auto``) for the same model, devices and batch.

    python -m benchmarks.auto_recipes                 # results/auto-recipes.md and .json
    python -m benchmarks.auto_recipes --only llama3-8b --no-search
    python -m benchmarks.auto_recipes --page-only      # the page again from the JSON (its texts edited)

Every figure of fxshard's is a prediction (the shipped h100 profile: datasheet peaks, stated efficiencies; nothing
here ran on a GPU), of fxshard's own program at that layout: transformers' modules op by op, its collectives as its
runtime issues them.  Where the recipe does what fxshard does not, the page says what, and by how much it counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.recipes import RECIPES, Recipe  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30


def hardware(name: str):
    """A shipped profile, or torchtitan's H100s: the h100 profile with the H100 NVL's dense peaks (the lower bound
    of the page's "between SXM and NVL"), 2.4 TB/s of HBM2e and 96 GB."""
    from fxshard.cost.hardware import load_hardware

    if name != "h100-hbm2e-500w":
        return load_hardware(name)
    hw = load_hardware("h100")
    return dataclasses.replace(hw, name="H100 96GB HBM2e at 500 W (torchtitan's)", memory_bandwidth=2.4e12,
                               memory=96 * 10**9, peak_flops=hw.peak_flops | {"bf16": 835e12, "fp16": 835e12,
                                                                              "fp8": 1671e12})


def predict_recipe(recipe: Recipe, profile, search_too: bool = True) -> dict:
    """The row of one recipe: the prediction at its own recompute, at the least recompute that fits (when its own
    does not), the memory terms of the worst rank, Megatron's formula where it applies, and the search's choice."""
    from fxshard.cost.search import Candidate, _least_recompute, search
    from fxshard.cost.timemodel import Evaluator, Setting, predict

    hw = hardware(recipe.hardware)
    layout = recipe.layout
    ev = Evaluator(profile, hw, "fp8" if recipe.precision == "fp8" else layout.dtype)  # fp8: the fp8 program's
    setting = Setting(recipe.seq, recipe.global_batch, hw.devices_per_node)
    own = predict(ev, layout, setting)
    row = {"recipe": recipe.name, "model": recipe.model, "gpus": recipe.gpus, "seq": recipe.seq,
           "global_batch": recipe.global_batch, "hardware": hw.name, "memory_limit": hw.memory,
           "published": recipe.published, "published_memory": recipe.memory, "source": recipe.source,
           "recipe_text": recipe.recipe, "differs": recipe.differs, "precision": recipe.precision,
           "own": _summary(own, recipe, ev)}
    if not own.fits:
        fit, _ = _least_recompute(ev, Candidate(layout), setting)
        row["fitting"] = _summary(predict(ev, fit.layout, setting), recipe, ev) if fit else None
    if recipe.megatron and "llama" in recipe.model:
        row["megatron"] = megatron_row(recipe, ev, own, setting)
    if search_too:
        started = time.perf_counter()
        try:
            found = search(profile, hw, recipe.gpus, setting, layout.dtype, top=3, evaluator=ev)
            best = found.ranked[0]
            row["auto"] = _summary(best, recipe) | {"accumulate": best.accumulate, "seconds": found.seconds,
                                                     "cpu_seconds": found.cpu_seconds, "considered": found.considered,
                                                     "fitting": found.fitting}
        except Exception as e:  # a refusal is a result too
            row["auto"] = {"error": str(e), "seconds": time.perf_counter() - started}
    return row


def _summary(pred, recipe: Recipe, ev=None) -> dict:
    worst = max(range(len(pred.peaks)), key=pred.peaks.__getitem__)
    out = {"layout": pred.layout.describe(), "tokens_per_s": pred.tokens_per_s,
           "ratio": pred.tokens_per_s / recipe.published, "step": pred.step, "mfu": pred.mfu, "terms": pred.terms,
           "peak": pred.peak, "fits": pred.fits, "worst_rank": worst, "memory": pred.memory_terms[worst]}
    if ev is not None:
        out["compute_split"] = compute_split(ev, pred.layout, recipe)
    return out


def compute_split(ev, layout, recipe: Recipe) -> dict:
    """The compute term of the busiest pp rank (forward and backward, without recompute), split by what runs:
    the matmuls (and grouped expert matmuls) at the roofline, attention, and the other ops at the memory bandwidth
    (norms, activations, residuals, RoPE, the loss; under fp8 also the casts), seconds a step."""
    from fxshard.cost.timemodel import BACKWARD, Setting, _prepared

    m, _, stages, cost = _prepared(ev, layout, Setting(recipe.seq, recipe.global_batch, ev.hw.devices_per_node))
    best: dict = {}
    for r in range(layout.pp):
        own = [stages[s] for s in (layout.stages_of(r) if layout.pp > 1 else [0])]
        split = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
        for stage in own:
            for name, n in stage:
                c = cost[name]
                mm, att = (1 + BACKWARD["matmul"]) * c.wgrad, (1 + BACKWARD["attention"]) * c.attention
                split["matmul"] += m * n * mm
                split["attention"] += m * n * att
                split["other ops"] += m * n * (c.fwd + c.bwd - mm - att)
        if sum(split.values()) > sum(best.values()):
            best = split
    return best


def megatron_row(recipe: Recipe, ev, pred, setting) -> dict:
    """Megatron's theoretical memory at the recipe's configuration beside fxshard's most loaded rank, term by term:
    the model state, one layer's activations for one microbatch, and the layer-microbatches the first pipeline
    rank holds."""
    from benchmarks.megatron_memory import SOURCE, from_llama, theoretical_memory
    from fxshard.cost.timemodel import _prepared

    config = _config(recipe.model)
    rows = recipe.global_batch // (recipe.layout.dp * (recipe.layout.microbatches or 1))
    formula = theoretical_memory(from_llama(config, recipe.layout, recipe.seq, rows), recipe.layout.microbatches)
    _, _, _, cost = _prepared(ev, recipe.layout, setting)
    mode = recipe.layout.recompute
    layer = cost["block0"].saved[mode]
    ours = pred.memory_terms[0]  # the first pipeline rank, the formula's
    terms, savings = layer_terms(config, recipe)
    state = ours["parameters"] + ours["gradients"] + ours["optimizer"] + ours["experts"]
    return {"source": SOURCE, "formula": formula,
            "fxshard": {"model_state": state, "layer_activations": layer, "activations": ours["activations"],
                        "layer_microbatches": ours["activations"] / layer, "other": ours["transient"] +
                        ours["recompute"], "total": sum(ours.values())},
            "formula_layer_microbatches": formula["activations"] / formula["layer_activations"],
            "layer_terms": terms, "savings": savings}


def layer_terms(config, recipe: Recipe) -> tuple[dict, dict]:
    """One layer's activations for one microbatch term by term, both ways (:mod:`benchmarks.layer_terms`):
    fxshard's at the tokens one cp rank holds, the formula's at the whole sequence (it knows no cp); and what the
    exact changes made to fxshard's program save of it."""
    from benchmarks.layer_terms import formula_layer, fxshard_layer, savings_made

    layout, h, ffn = recipe.layout, config.hidden_size, config.intermediate_size
    heads, kv, seq = config.num_attention_heads, config.num_key_value_heads, recipe.seq // getattr(layout, "cp", 1)
    return {"fxshard": fxshard_layer(h, ffn, heads, kv, seq, layout.tp, sp=layout.sp),
            "formula": formula_layer(h, ffn, recipe.seq, layout.tp)}, savings_made(h, ffn, heads, kv, seq, layout.tp)


def _config(model_file: str):
    import torch

    from fxshard.capture.modelfile import load_model_file

    with torch.device("meta"):
        return load_model_file(ROOT / model_file).make_model().config


def run(names: list[str] | None = None, search_too: bool = True) -> list[dict]:
    from fxshard.cost.profile import model_profile

    rows, profiles = [], {}
    for recipe in RECIPES:
        if names and recipe.name not in names:
            continue
        # an fp8 recipe: the program --dtype fp8 compiles (its fp8 linears, their casts and amaxes, what they keep)
        key = (recipe.model, "fp8" if recipe.precision == "fp8" else recipe.layout.dtype)
        started = time.perf_counter()
        if key not in profiles:
            profiles[key] = model_profile(ROOT / recipe.model, dtype=key[1])
        row = predict_recipe(recipe, profiles[key], search_too) | {"capture_s": time.perf_counter() - started}
        rows.append(row)
        print(f"{recipe.name}: predicted {row['own']['tokens_per_s']:,.0f} tok/s/GPU vs published "
              f"{recipe.published:,} ({row['own']['ratio']:.2f}), peak {row['own']['peak'] / GIB:.0f} GiB", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    from benchmarks.recipes_page import page

    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_recipes", description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=[r.name for r in RECIPES])
    parser.add_argument("--no-search", action="store_true", help="leave out plan --auto's own choice")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--page-only", action="store_true",
                        help="rewrite the page from the JSON beside it (the recipes' texts from benchmarks.recipes)")
    args = parser.parse_args(argv)
    name = "auto-recipes" if not args.only else "auto-recipes-" + "-".join(args.only)
    if args.page_only:
        text = {r.name: r for r in RECIPES}
        rows = [row | {"recipe_text": text[row["recipe"]].recipe, "differs": text[row["recipe"]].differs,
                       "source": text[row["recipe"]].source, "precision": text[row["recipe"]].precision}
                for row in json.loads((args.out / f"{name}.json").read_text())]
    else:
        rows = run(args.only, search_too=not args.no_search)
    # the repository's results, as benchmarks.common.write_results writes them (not a user's file)
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    (args.out / f"{name}.md").write_text(page(rows) + "\n")


if __name__ == "__main__":
    main()
