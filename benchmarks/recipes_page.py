"""The results page of :mod:`benchmarks.auto_recipes`: its rows as tables, each miss with its terms.

Everything on the page is computed from the rows (the JSON beside it) or stated in :mod:`benchmarks.recipes`;
nothing is typed in by hand, so a rerun rewrites it whole::

    page(json.loads(Path("benchmarks/results/auto-recipes.json").read_text()))
"""

from __future__ import annotations

import datetime

GIB = 2**30
TERMS = ("compute", "recompute", "tp communication", "cp communication", "ep communication", "dp communication",
         "stage imbalance", "pipeline bubble", "optimizer step")
WITHIN = 0.25  # the target: predicted tokens/s within 25% of the published


def page(rows: list[dict]) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"`python -m benchmarks.auto_recipes` ({stamp}): fxshard's time and memory model at published runs' own "
           "layouts, precision and recompute. Every fxshard figure is a prediction of fxshard's own program at that "
           "layout (transformers' modules op by op, its runtime's collectives); nothing here ran on a GPU. The "
           "published figures are measurements of the peers' programs (sources below).", ""]
    out += _throughput(rows) + _terms(rows) + _memory(rows) + _megatron(rows) + _auto(rows) + _notes(rows)
    return "\n".join(out)


def _throughput(rows) -> list[str]:
    lines = ["## Throughput", "",
             "| recipe | published tok/s/GPU | fxshard predicts at | predicted tok/s/GPU | ratio | peak (device) | "
             "at the least recompute that fits | ratio |",
             "|---|---:|---|---:|---:|---|---|---:|"]
    for r in rows:
        own, fit = r["own"], r.get("fitting")
        fits = f"{own['peak'] / GIB:.0f} GiB ({r['memory_limit'] / GIB:.0f}): {'fits' if own['fits'] else 'over'}"
        other = ("(its own)", "") if own["fits"] else (
            (f"{_recompute(fit['layout'])}: {fit['tokens_per_s']:,.0f}", f"{fit['ratio']:.2f}") if fit
            else ("none fits", ""))
        at = own["layout"] + (" (matmuls in fp8)" if r.get("precision") == "fp8" else "")
        lines.append(f"| {r['recipe']} | {r['published']:,} | {at} | {own['tokens_per_s']:,.0f} | "
                     f"{own['ratio']:.2f}{_mark(own['ratio'])} | {fits} | {other[0]} | {other[1]} |")
    within = [r["recipe"] for r in rows if abs(r["own"]["ratio"] - 1) <= WITHIN]
    lines += ["", f"Within ±{WITHIN:.0%} of the published figure at the recipe's own layout: "
              f"{', '.join(within) or 'none'} (of {len(rows)}). A ratio marked * misses; the terms below say why.", ""]
    return lines


def _mark(ratio: float) -> str:
    return "" if abs(ratio - 1) <= WITHIN else " *"


def _recompute(layout: str) -> str:
    return next((w for w in layout.split() if w.startswith("recompute=")), "recompute=none")


def _terms(rows) -> list[str]:
    lines = ["## What the predicted step is made of", "",
             "Seconds of one step on the critical rank (the one that finishes last; exposed communication only: "
             "what runs beside compute is not counted, recompute's collectives included), beside the step the "
             "published figure implies (global batch x sequence / (tok/s/GPU x GPUs)). The terms add up to the "
             "step: the rank's idle time is split into the stage imbalance (waiting for the busiest rank's extra "
             "work: stages of unequal layers) and the pipeline bubble (fill and drain, about (pp-1)/(vp·m) of the "
             "work on even stages).", "",
             "| recipe | published step | predicted step | " + " | ".join(t.replace(" communication", "")
                                                                   for t in TERMS) + " |",
             "|---|---:|---:|" + "---:|" * len(TERMS)]
    for r in rows:
        for label, p in (("", r["own"]), (" (fitting)", r.get("fitting"))):
            if p:
                lines.append(f"| {r['recipe']}{label} | {published_step(r):.2f} | {p['step']:.2f} | "
                             + " | ".join(f"{p['terms'].get(t, 0.0):.2f}" for t in TERMS) + " |")
    lines += ["", "The compute term split by what runs (seconds a step, the busiest pp rank, forward and backward "
              "without recompute): the matmuls at the roofline (fp8 rows: at the fp8 peak), attention at the "
              "profile's efficiency for the sequence, and every other op at the memory bandwidth (norms, SwiGLU, "
              "RoPE, residuals, the loss; in fp8 rows also the float8 casts): the ops Transformer Engine and "
              "torch.compile fuse, which fxshard's eager program runs one by one.", "",
              "| recipe | matmul | attention | other ops | other ops' share |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        split = r["own"].get("compute_split")
        if split:
            lines.append(f"| {r['recipe']} | {split['matmul']:.2f} | {split['attention']:.2f} | "
                         f"{split['other ops']:.2f} | {split['other ops'] / sum(split.values()):.0%} |")
    return lines + [""] + _without_fusion(rows)


def _without_fusion(rows) -> list[str]:
    """For each row predicted slower than ±25%: its step less the two terms the published programs fuse or hide
    (the other ops, which Transformer Engine and torch.compile fuse into few kernels; the exposed tp collectives,
    which Megatron's userbuffers overlap with the GEMMs): what is left for the other differences to explain."""
    slow = [r for r in rows if r["own"]["ratio"] < 1 - WITHIN and r["own"].get("compute_split")]
    if not slow:
        return []
    lines = ["The slow rows without the two differences every one of them has (a bound, not a prediction: fused "
             "kernels are not free and not every tp collective hides):", ""]
    for r in slow:
        own = r["own"]
        other, tp = own["compute_split"]["other ops"], own["terms"].get("tp communication", 0.0)
        left = own["step"] - other - tp
        lines.append(f"- {r['recipe']}: {own['step']:.2f} s less other ops {other:.2f} s and tp {tp:.2f} s: "
                     f"{left:.2f} s, against the published {published_step(r):.2f} s"
                     + (" (the rest: the recipe's other differences, below)" if left > published_step(r) else "")
                     + ".")
    return lines + [""]


def published_step(row: dict) -> float:
    """Seconds of one step the published throughput implies."""
    return row["global_batch"] * row["seq"] / (row["published"] * row["gpus"])


def _memory(rows) -> list[str]:
    lines = ["## Memory of the most loaded rank, both ways", "",
             "fxshard's predicted peak (GiB) at the recipe's own recompute, term by term, beside what the "
             "publication measured (torchtitan) or Megatron-LM's theoretical formula gives (Megatron rows; its terms "
             "in the next table).", "",
             "| recipe | recompute | parameters | gradients | optimizer | experts | activations | transient + "
             "recompute | fxshard | other way | fxshard / other |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        m, own = r["own"]["memory"], r["own"]
        other, ratio = "-", ""
        if r.get("published_memory"):
            other, ratio = f"{r['published_memory']:.1f} measured", f"{own['peak'] / GIB / r['published_memory']:.2f}"
        elif r.get("megatron"):
            total = r["megatron"]["formula"]["total"]
            other, ratio = f"{total / GIB:.1f} formula", f"{own['peak'] / total:.2f}"
        lines.append(f"| {r['recipe']} | {_recompute(own['layout'])} | " + " | ".join(
            f"{m[k] / GIB:.1f}" for k in ("parameters", "gradients", "optimizer", "experts", "activations"))
            + f" | {(m['transient'] + m['recompute']) / GIB:.1f} | {own['peak'] / GIB:.1f} | {other} | {ratio} |")
    return lines + [""]


def _megatron(rows) -> list[str]:
    mega = [r for r in rows if r.get("megatron")]
    if not mega:
        return []
    lines = ["## Against Megatron-LM's theoretical memory, term by term", "",
             f"The formula: {mega[0]['megatron']['source']}, restated in `benchmarks/megatron_memory.py` (with "
             "SwiGLU's third MLP matrix counted, as later versions of the file do). Both sides are the first pipeline "
             "rank at the recipe's own configuration.", "",
             "| recipe | term | fxshard | formula | fxshard / formula |", "|---|---|---:|---:|---:|"]
    for r in mega:
        f, x = r["megatron"]["formula"], r["megatron"]["fxshard"]
        for term, ours, theirs, unit in (
                ("model state (GiB)", x["model_state"], f["weights_and_optimizer"], GIB),
                ("one layer, one microbatch (MiB)", x["layer_activations"], f["layer_activations"], 2**20),
                ("layer-microbatches held", x["layer_microbatches"], r["megatron"]["formula_layer_microbatches"], 1),
                ("activations (GiB)", x["activations"], f["activations"], GIB),
                ("total (GiB)", x["total"], f["total"], GIB)):
            lines.append(f"| {r['recipe']} | {term} | {ours / unit:,.1f} | {theirs / unit:,.1f} | "
                         f"{ours / theirs:.2f} |")
    lines += ["", "Why they differ where they do (over 10%):", "",
              "- **model state**: the formula charges `6 + 12/dp` bytes a parameter (bf16 weight, fp32 gradient, "
              "the fp32 master and Adam moments over Megatron's dp, which leaves cp out); fxshard's ZeRO 1 keeps bf16 "
              "gradients (as these recipes do: `grad_reduce_in_fp32 False`) and shards the optimizer over dp x cp: "
              "`4 + 12/(dp·cp)`. The formula also puts the whole embedding on the rank with the most layers; "
              "fxshard counts the first stage's embedding and the last stage's head where they are.",
              "- **one layer's activations**: term by term in the next table. Both are differences of the "
              "programs: fxshard's figure is what its program saves (`fxshard.cost.saved` traces it; "
              "`benchmarks/layer_terms.py` restates it, `tests/benchmarks/test_layer_terms.py` checks the "
              "restatement against the trace), the formula's Korthikanti et al.'s GPT layer (`18·s·b·h + "
              "4·s·b·ffn` bytes over tp, the whole sequence: it knows no cp), the layer Transformer Engine's "
              "fused kernels run.",
              "- **layer-microbatches held**: the same on both sides where the schedule is the same: torch's "
              "interleaved 1F1B keeps `pp + (pp - 1)/vp` microbatches of the first rank's layers alive, Megatron's "
              "penalty `1 + (pp - 1)/(pp·vp)` on all layers; fxshard's first stage holds the embedding and one "
              "layer less where the balance gives it fewer.", ""]
    return lines + _layer_terms(mega)


def _layer_terms(mega) -> list[str]:
    """One layer's activations for one microbatch, term by term both ways, and what exact changes to fxshard's
    program would save (benchmarks.layer_terms)."""
    from benchmarks.layer_terms import TERMS

    rows = [r for r in mega if r["megatron"].get("layer_terms")]
    if not rows:
        return []
    lines = ["One layer, one microbatch, term by term (MiB):", "",
             "| recipe | " + " | ".join(TERMS) + " | total |", "|---|" + "---:|" * (len(TERMS) + 1)]
    for r in rows:
        for side in ("fxshard", "formula"):
            t = r["megatron"]["layer_terms"][side]
            lines.append(f"| {r['recipe']} ({side}) | " + " | ".join(f"{t[k] / 2**20:,.1f}" for k in TERMS)
                         + f" | {sum(t.values()) / 2**20:,.1f} |")
    lines += ["", "- **norms**: each keeps its bf16 input (`rt.rms_normalize` runs transformers' fp32 ops again in "
              "backward: 2h bytes a token) and the weight's `mul` the bf16 normalized output (2h), against the 2h "
              "input TE's fused RMSNorm keeps.",
              "- **column-parallel inputs**: the q/k/v and gate/up linears keep their input's sequence-parallel "
              "shard (2h a token each, over tp) and all-gather it again in backward (`rt.linears_regathered`), as "
              "Megatron does; under `--fp8` likewise (`rt.fp8_linears_regathered`, which casts the gathered input "
              "again in backward as torchao casts the input it saved), so an fp8 program keeps what the bf16 one "
              "keeps, layer by layer (`tests/cost/test_fp8_cost.py`). The rows marked \"matmuls in fp8\" are priced "
              "with the program `--dtype fp8` compiles (`benchmarks/auto_recipes.py`): its fp8 linears at the fp8 "
              "peak, their casts as the runtime runs them (the input q/k/v or gate/up share cast once each way, the "
              "output gradient twice in backward, the head in bf16), their amax all-reduces, and what they keep.",
              "- **attention**: SDPA keeps q, k, v, its output (o_proj's input: the same storage) and the "
              "logsumexp; k and v at the kv heads (`enable_gqa`, as Megatron's flash attention keeps them), where "
              "the formula counts K and V at h.",
              "- **MLP**: SwiGLU keeps gate, up and their product (`rt.silu_mul` computes silu(gate) again in "
              "backward: 6·ffn bytes a token over tp, as TE's SwiGLU) against a GELU MLP's 4·ffn in the formula.",
              "- **dropout masks**: the formula's 1-byte masks after attention and the MLP; Llama trains without "
              "dropout. **RoPE**: the cos and sin tables, once a microbatch.", ""]
    for r in rows:
        saved = r["megatron"].get("savings")
        if saved:
            held = r["megatron"]["fxshard"]["layer_microbatches"]
            total = sum(saved.values())
            lines.append(f"Exact changes made to fxshard's program, what each keeps less ({r['recipe']}, MiB a "
                         f"layer; `tests/test_saved_activations.py` measures each): "
                         + "; ".join(f"{k} {v / 2**20:,.0f}" for k, v in saved.items())
                         + f": {total / 2**20:,.0f} MiB a layer, {total * held / GIB:,.1f} GiB at its "
                         f"{held:,.0f} layer-microbatches; the peak before them about "
                         f"{(r['own']['peak'] + total * held) / GIB:,.1f} GiB ({r['memory_limit'] / GIB:.0f}).")
    return lines + [""]


def _auto(rows) -> list[str]:
    auto = [r for r in rows if r.get("auto")]
    if not auto:
        return []
    lines = ["## fxshard's own choice (`plan --auto`)", "",
             "The search over every layout of the same devices, batch and sequence, in the recipe's precision, each "
             "at the least recompute that fits. Its figures are predictions, not measurements: where one beats the "
             "published figure, the terms say why fxshard's model prefers it, not that it runs faster.", "",
             "| recipe | fxshard's choice | its prediction | vs published | vs at the recipe's layout | search |",
             "|---|---|---:|---:|---:|---:|"]
    for r in auto:
        a = r["auto"]
        if "error" in a:
            lines.append(f"| {r['recipe']} | refused: {a['error'][:160]} | - | - | - | {a['seconds']:.0f} s |")
            continue
        choice = a["layout"] + (f" grad-accum={a['accumulate']}" if a["accumulate"] > 1 else "")
        base = r["own"] if r["own"]["fits"] else (r.get("fitting") or r["own"])
        lines.append(f"| {r['recipe']} | {choice} | {a['tokens_per_s']:,.0f} | {a['ratio']:.2f} | "
                     f"{a['tokens_per_s'] / base['tokens_per_s']:.2f} | {a['seconds']:.0f} s "
                     f"({a['cpu_seconds']:.0f} s CPU) |")
    return lines + [""]


def _notes(rows) -> list[str]:
    lines = ["## The recipes, and what fxshard does differently", ""]
    for r in rows:
        lines += [f"- **{r['recipe']}** ({r['gpus']} GPUs, sequence {r['seq']}, global batch {r['global_batch']}, "
                  f"predicted on {r['hardware']}): published {r['published']:,} tok/s/GPU"
                  + (f", {r['published_memory']} GiB" if r.get("published_memory") else "")
                  + f", {r['source']}. The run: {r['recipe_text']}. fxshard differs: {r['differs']}."]
    return lines
