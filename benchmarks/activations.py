"""Bytes saved for backward per transformer layer per token, next to Korthikanti et al. 2022 and to ``fxshard plan``.

The model is samples/gpt.py's architecture (pre-norm blocks: LayerNorm, q/k/v/o attention through
``scaled_dot_product_attention``, a 4h GELU MLP; no dropout) at :data:`SHAPE`, in bf16 so activations take
2 bytes as in the paper's accounting.  Each setting is compiled at two depths and trained one step on gloo
processes; ``fxshard run --memory-report``'s probe (:mod:`fxshard.train.memory`) notes every tensor autograd
saves in one microbatch's forward, and the outputs selective recompute keeps.  What is not a layer (the
embeddings, the final norm, the LM head, the loss) is the same at both depths, so

    per layer = (saved at L2 layers - saved at L1 layers) / (L2 - L1)

is exactly one layer's bytes; divided by the tokens of the microbatch (s·b) it is per token.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4) count, per
layer, 16-bit activations and 1-byte dropout masks (s sequence, b microbatch, h hidden, a heads, t tp)::

    none (t = 1)              sbh(34 + 5as/h)
    tensor parallel           sbh(10 + 24/t + 5as/(ht))
    + sequence parallel       sbh(34/t + 5as/(ht))
    tp + selective            sbh(10 + 24/t)
    tp + sp + selective       34·sbh/t
    full recompute            2sbh             (the layer's input; 2sbh/t with sequence parallelism)

:data:`TERMS` is the paper's itemization; a row's formula is their sum under the setting, and "terms that apply"
leaves out what this model does not have: dropout (three masks and the dropped-out attention probabilities) and
the a·s² attention scores, which the fused ``scaled_dot_product_attention`` kernel (CPU and CUDA flash) does not
keep; it keeps a logsumexp of a·s·b fp32 values instead, which is added.

Sequence-parallel rows run when :class:`fxshard.ir.context.Layout` has an ``sp`` field (``--sp``); otherwise they
are reported "not built".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import markdown_table, spawn

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "gpt.py"
SHAPE = {"vocab": 512, "seq": 256, "hidden": 256, "heads": 4, "batch": 1}
QUICK_SHAPE = {"vocab": 128, "seq": 32, "hidden": 64, "heads": 4, "batch": 1}
DEPTHS = (1, 3)  # L1, L2: the per-layer figure is their difference over 2 layers
TARGET = 1.15  # the bound on measured / formula


@dataclass(frozen=True)
class Term:
    """One activation Korthikanti et al. count per layer: bytes per token as ``h_coef·h + as_coef·a·s``; whether
    tensor parallelism alone divides it by t (sequence parallelism divides every term); and what the model needs
    for it (``"dropout"``, ``"scores"``: the softmax's a·s² matrix) or ``""``."""

    name: str
    h_coef: float = 0
    as_coef: float = 0
    tp_split: bool = False
    needs: str = ""


TERMS = (
    Term("ln_1 input", h_coef=2),
    Term("q/k/v projection input", h_coef=2),
    Term("Q, K (for QK^T)", h_coef=4, tp_split=True),
    Term("softmax output", as_coef=2, tp_split=True, needs="scores"),
    Term("attention dropout mask", as_coef=1, tp_split=True, needs="dropout"),
    Term("dropped-out attention probabilities", as_coef=2, tp_split=True, needs="dropout"),
    Term("V", h_coef=2, tp_split=True),
    Term("o_proj input", h_coef=2, tp_split=True),
    Term("attention residual dropout mask", h_coef=1, needs="dropout"),
    Term("ln_2 input", h_coef=2),
    Term("fc_in input", h_coef=2),
    Term("GELU input", h_coef=8, tp_split=True),
    Term("fc_out input (GELU output)", h_coef=8, tp_split=True),
    Term("MLP residual dropout mask", h_coef=1, needs="dropout"),
)
LOGSUMEXP = 4  # bytes per head per token: the fused attention kernel's fp32 logsumexp, in place of the scores
NORM_STATS = 8  # bytes per token: two LayerNorms' mean and rstd, kept in the compute dtype (bf16)


@dataclass(frozen=True)
class Setting:
    name: str
    tp: int = 1
    sp: bool = False
    recompute: str = "none"

    def layout(self, dtype: str = "bf16"):
        from fxshard.ir.context import Layout

        extra = {"sp": True} if self.sp else {}
        return Layout(tp=self.tp, recompute=self.recompute, dtype=dtype, **extra)


SETTINGS = (
    Setting("none", tp=1),
    Setting("TP", tp=2),
    Setting("TP+SP", tp=2, sp=True),
    Setting("TP+selective", tp=2, recompute="selective"),
    Setting("TP+SP+selective", tp=2, sp=True, recompute="selective"),
    Setting("full", tp=2, recompute="full"),
)


def sp_built() -> bool:
    """Whether this fxshard has sequence parallelism (``Layout.sp``, ``--sp``)."""
    from fxshard.ir.context import Layout

    return "sp" in {f.name for f in dataclasses.fields(Layout)}


def formula(setting: Setting, h: int, a: int, s: int, applies=lambda term: True) -> float:
    """Korthikanti's bytes per layer per token under ``setting``, summed over the terms ``applies`` accepts (all:
    the paper's formula).  Selective recompute recomputes the a·s² terms; full recompute keeps the layer's input."""
    t = setting.tp
    if setting.recompute == "full":
        return 2 * h / (t if setting.sp else 1)
    total = 0.0
    for term in TERMS:
        if setting.recompute == "selective" and term.as_coef or not applies(term):
            continue
        total += (term.h_coef * h + term.as_coef * a * s) / (t if setting.sp or term.tp_split else 1)
    return total


def in_this_model(setting: Setting, h: int, a: int, s: int) -> float:
    """The formula over the terms this model has (no dropout, no kept a·s² scores); without recompute also what
    the paper leaves out as small: the fused attention's fp32 logsumexp and the norms' mean and rstd."""
    kept = formula(setting, h, a, s, applies=lambda term: not term.needs)
    if setting.recompute == "none":
        kept += LOGSUMEXP * a / setting.tp + NORM_STATS / (setting.tp if setting.sp else 1)
    return kept


def selective_keeps(h: int, a: int, t: int) -> tuple[float, str]:
    """What fxshard's ``--recompute selective`` keeps per layer per token without sequence parallelism (the
    outputs of every matmul and the fused attention kernel, and the block's input, which checkpoint saves), as
    bytes and as the sum that gives them.  Korthikanti's selective recompute keeps the norms' and the GELU's
    inputs instead and recomputes the attention core; fxshard keeps the attention kernel's output (it holds
    no a·s² matrix) and recomputes norms, GELU and residual adds."""
    parts = {"block input 2h": 2 * h, "Q, K, V 6h/t": 6 * h / t, "attention output 2h/t": 2 * h / t,
             "its logsumexp 4a/t": LOGSUMEXP * a / t,
             "o_proj and fc_out outputs (before the all-reduce) 2h + 2h": 4 * h,
             "fc_in output 8h/t": 8 * h / t}
    return sum(parts.values()), " + ".join(f"{k} ({v:g})" for k, v in parts.items())


def terms_text(setting: Setting, h: int, a: int) -> str:
    """Which of the paper's terms apply to this model under ``setting``, and what fxshard keeps instead."""
    if setting.recompute == "full":
        return "the layer's input only (what checkpoint saves), as in the formula"
    absent = ["dropout (3 masks, the dropped-out probabilities): the model has none"]
    if setting.recompute == "none":
        absent.append("the softmax's a·s² scores: fused sdpa keeps a logsumexp (4a/t bytes per token) instead; "
                      f"added: that and the norms' mean and rstd ({NORM_STATS} bytes)")
    text = "absent: " + "; ".join(absent)
    if setting.recompute == "selective" and not setting.sp:
        total, parts = selective_keeps(h, a, setting.tp)
        text += (f". fxshard's selective recompute keeps {parts} = {total:g} bytes, less than Korthikanti's (which "
                 "keeps the norms' and GELU's inputs); it recomputes norms, GELU and the residual adds, and with them "
                 "the attention's output all-reduce")
    return text


def model_file(folder: Path, layers: int, shape: dict) -> Path:
    """samples/gpt.py at ``shape`` with ``layers`` blocks, written to ``folder`` (a model file is self-contained:
    ``fxshard compile`` copies it next to the rank files, which read the batches from it)."""
    path = folder / f"gpt_h{shape['hidden']}_s{shape['seq']}_L{layers}.py"
    path.write_text(SAMPLE.read_text() + (
        "\n\n# the benchmarks' activation shape (benchmarks/activations.py)\n"
        f"VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = {shape['vocab']}, {shape['seq']}, {shape['hidden']}, "
        f"{shape['heads']}, {layers}, {shape['batch']}\n\n\n"
        "def make_model():\n    return GPT(VOCAB, SEQ, HIDDEN, HEADS, LAYERS)\n"))
    return path


def run(workdir: Path, quick: bool = False, log=print, only: tuple[str, ...] | None = None) -> dict:
    """Compile, measure and plan every built setting (or those named in ``only``) at both depths; the result as
    JSON-ready data."""
    from fxshard.cost.costs import plan_costs
    from fxshard.driver import compile as compile_model
    from fxshard.testing import measure_on_rank

    shape = QUICK_SHAPE if quick else SHAPE
    files = {depth: model_file(workdir, depth, shape) for depth in DEPTHS}
    chosen = [s for s in SETTINGS if only is None or s.name in only]
    built = [s for s in chosen if not s.sp or sp_built()]
    outs: dict[int, dict[str, str]] = {}  # world -> case name -> compiled folder
    plans = {}
    for setting in built:
        for depth, path in files.items():
            case = f"{setting.name}-L{depth}"
            out = workdir / f"activations-{case}"
            outs.setdefault(setting.tp, {})[case] = str(compile_model(path, setting.layout(), out=out).out)
            plans[case] = plan_costs(path, setting.layout()).ranks[0]["saved"].value
    log(f"activations: {len(built)} settings x depths {DEPTHS}, {sum(map(len, outs.values()))} programs")
    measured: dict[str, list[int]] = {}
    for world, cases in outs.items():
        for rank, per_case in enumerate(spawn(measure_on_rank, world, cases, 1, timeout=900)):
            for case, sample in per_case.items():
                measured.setdefault(case, [0] * world)[rank] = sample["saved"]
    rows = [_row(setting, shape, measured, plans) for setting in built]
    rows += [{"setting": s.name, "built": False} for s in chosen if s.sp and not sp_built()]
    return {"model": "samples/gpt.py architecture", "shape": shape, "depths": list(DEPTHS), "dtype": "bf16",
            "target": TARGET, "rows": rows}


def _row(setting: Setting, shape: dict, measured: dict, plans: dict) -> dict:
    h, a, s, b = shape["hidden"], shape["heads"], shape["seq"], shape["batch"]
    l1, l2 = DEPTHS
    tokens = s * b
    low, high = measured[f"{setting.name}-L{l1}"], measured[f"{setting.name}-L{l2}"]
    per_layer = [(y - x) / (l2 - l1) / tokens for x, y in zip(low, high, strict=True)]
    plan_layer = (plans[f"{setting.name}-L{l2}"] - plans[f"{setting.name}-L{l1}"]) / (l2 - l1) / tokens
    paper, kept = formula(setting, h, a, s), in_this_model(setting, h, a, s)
    return {
        "setting": setting.name, "built": True, "tp": setting.tp, "sp": setting.sp, "recompute": setting.recompute,
        "per_layer_per_token": per_layer[0], "same_on_every_rank": len(set(per_layer)) == 1,
        "formula": paper, "ratio": per_layer[0] / paper, "meets_target": per_layer[0] <= TARGET * paper,
        "formula_in_this_model": kept, "ratio_in_this_model": per_layer[0] / kept, "terms": terms_text(setting, h, a),
        "plan_per_layer_per_token": plan_layer, "per_layer_measured_over_plan": per_layer[0] / plan_layer,
        "saved": {f"L{d}": measured[f"{setting.name}-L{d}"] for d in DEPTHS},
        "plan": {f"L{d}": plans[f"{setting.name}-L{d}"] for d in DEPTHS},
        "measured_over_plan": {f"L{d}": [m / plans[f"{setting.name}-L{d}"] for m in measured[f"{setting.name}-L{d}"]]
                               for d in DEPTHS},
    }


def markdown(result: dict) -> str:
    sh = result["shape"]
    head = (f"{result['model']} at h = {sh['hidden']}, a = {sh['heads']}, s = {sh['seq']}, b = {sh['batch']}, "
            f"{result['dtype']}; per layer = (saved at {result['depths'][1]} layers − saved at "
            f"{result['depths'][0]}) / {result['depths'][1] - result['depths'][0]}, per token = / (s·b). "
            "Bytes per layer per token, rank 0 (every tp rank measured the same unless marked). Formula: Korthikanti "
            "et al. 2022; \"in this model\": its terms this model has (no dropout; fused attention keeps a logsumexp, "
            f"not the a·s² scores). Target: measured ≤ {result['target']}× the formula.")
    rows, notes = [], []
    for r in result["rows"]:
        if not r["built"]:
            rows.append([r["setting"], "not built (no `Layout.sp` in this fxshard)", *["—"] * 7])
            continue
        over = r["measured_over_plan"].values()
        ranks = min(min(v) for v in over), max(max(v) for v in over)
        rows.append([r["setting"], f"{r['per_layer_per_token']:.1f}" + ("" if r["same_on_every_rank"] else " (rank 0)"),
                     f"{r['formula']:.1f}", f"**{r['ratio']:.3f}**" + (" ✓" if r["meets_target"] else " ✗"),
                     f"{r['formula_in_this_model']:.1f}", f"{r['ratio_in_this_model']:.3f}",
                     f"{r['plan_per_layer_per_token']:.1f}", f"{r['per_layer_measured_over_plan']:.3f}",
                     f"{ranks[0]:.3f}–{ranks[1]:.3f}"])
        notes.append(f"- {r['setting']}: {r['terms']}")
    table = markdown_table(["setting", "measured B/layer/token", "formula", "measured ÷ formula",
                            "formula, terms in this model", "measured ÷ that", "plan B/layer/token",
                            "measured ÷ plan, per layer", "measured ÷ plan, whole rank (every rank, both depths)"],
                           rows)
    return "\n\n".join([head, table, "\n".join(notes)])
