"""Parallel styles, decorators and plans keyed by module FQN globs.

A plan maps module paths to styles::

    PLAN = {
        "layers.*.mlp.fc_in": fxshard.colwise(),
        "layers.*.mlp.fc_out": fxshard.rowwise(),
        "lm_head": fxshard.colwise(gather_output=True),
    }

Sources, highest priority first: the plan given to ``compile`` (``--plan plan.py``), decorators in
the model code (``@fxshard.parallelize(fc_in=fxshard.colwise(), ...)`` on a class, or
``fxshard.parallelize(module, ...)`` on an instance), the plan a Hugging Face model ships
(``_tp_plan`` / ``config.base_model_tp_plan``), and, when none of these gives anything, automatic
Megatron pairing (``fxshard/plan/auto.py``).  Keys are globs over dotted path components
(``*`` matches one component); a key of the user's plan that matches no module is a warning naming it.
What fxshard does differently from a model's own plan (expert layers, keys its configuration lacks) is
one compile note, not a warning: the user did not write that plan.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field

import torch

from fxshard.errors import PlanError


@dataclass(frozen=True)
class Style:
    """How one module's weights are split over the tensor-parallel axis."""

    kind: str  # "colwise" | "rowwise" | "vocab" | "replicate" | "experts"
    packed: int = 1  # colwise only: number of packed blocks (fused q/k/v = 3); 0 = infer from the split
    gather_output: bool = False  # colwise only: all-gather the output (an output head before the loss)

    def __post_init__(self):
        if self.kind not in ("colwise", "rowwise", "vocab", "replicate", "experts"):
            raise PlanError(f"unknown parallel style {self.kind!r}; use colwise, rowwise, vocab, replicate or experts")

    def __str__(self) -> str:
        if self.kind == "experts":
            return "moe_tp_experts()"
        opts = []
        if self.packed != 1:
            opts.append(f"packed={self.packed}")
        if self.gather_output:
            opts.append("gather_output=True")
        return f"{self.kind}({', '.join(opts)})"

    @property
    def role(self) -> str:
        return {"colwise": "column-parallel", "rowwise": "row-parallel", "vocab": "vocab-parallel",
                "replicate": "replicated", "experts": "expert tensor-parallel"}[self.kind]


def colwise(packed: int = 1, gather_output: bool = False) -> Style:
    """Split a Linear's output features (Megatron column-parallel).

    ``packed=3`` for a fused q/k/v projection (each block split separately; ``0`` infers the count
    from the split that follows); ``gather_output=True`` all-gathers the output (an LM head).
    """
    return Style("colwise", packed, gather_output)


def rowwise() -> Style:
    """Split a Linear's input features (Megatron row-parallel); the output is all-reduced, bias added once."""
    return Style("rowwise")


def vocab_parallel() -> Style:
    """Split an Embedding over its rows (the vocabulary); lookups are masked and all-reduced."""
    return Style("vocab")


def replicate() -> Style:
    """Keep a module whole on every rank."""
    return Style("replicate")


def moe_tp_experts() -> Style:
    """Split every expert of a mixture-of-experts experts module over tp (Megatron-Core's expert tensor
    parallelism): the first grouped matmul's weight by its columns (packed gate/up: each half split), the
    second's by its rows, so each rank holds 1/tp of each expert's intermediate size and the second grouped
    matmul's partial sums are all-reduced.  Transformers' plans name it (``layers.*.mlp.experts``); give the
    experts module ``replicate()`` instead to keep the experts whole on every tp rank
    (:mod:`fxshard.plan.experts`).
    """
    return Style("experts")


# Every parallel style transformers ships (its ALL_PARALLEL_STYLES registry, the plans of its models), by
# name: what fxshard does with a module the model's own plan gives that style.  fxshard places each value
# by propagation and inserts the communication that placement needs, so transformers' input/output
# layouts (a replicated input to a row-parallel layer is sliced on each rank; a partial output is reduced)
# come out of the split itself.
_HF_STYLES = {
    "colwise": colwise(),
    "rowwise": rowwise(),
    "colwise_gather_output": colwise(gather_output=True),
    "colwise_rep": colwise(gather_output=True),
    "rowwise_split_input": rowwise(),  # the replicated input is sliced on each rank, with no communication
    "rowwise_rep": rowwise(),
    "packed_colwise": colwise(packed=0),  # fused gate/up: the blocks come from the split that follows
    "embedding_rowwise": vocab_parallel(),
    "embedding_colwise": colwise(),  # an Embedding split over its hidden dim
    "vocab": vocab_parallel(),
    "replicate": replicate(),
    "moe_tp_experts": moe_tp_experts(),  # the experts' weights' own entries are implied (fxshard/plan/experts.py)
    # the weight gradient's sum over ranks follows from the placements; no style of its own
    "replicated_with_grad_allreduce": replicate(),
    "mla_kv_a_proj": replicate(),  # same: the rope part's gradient is summed because it meets split heads
}

# Styles that only say where transformers puts communication fxshard derives itself: nothing to attach.
_HF_IMPLIED = {
    "all_reduce": "the partial sums of a module's split layers are reduced where they are used",
    "local_params": "every rank file runs on its local shards",
}

_EXPERTS = ("experts stay whole on every tp rank, training exactly as on one device at their full size on each "
            "rank (--ep N splits them over N data-parallel ranks instead)")
_EP_PLAN = ("the expert-parallel plan is what --ep N does (experts split over N data-parallel ranks, rows exchanged "
            "all-to-all)")
# Styles fxshard does not implement, with what it does instead; a compile note lists the entries.
_HF_INSTEAD = {
    "moe_identity_expert": _EXPERTS,
    "ep_dispatch_experts": _EP_PLAN,
    "grouped_gemm": _EP_PLAN,
    "packed_rowwise": _EXPERTS,  # shipped only on experts' fused gate/up weights
    "sequence_parallel": "norms stay replicated over the whole sequence (fxshard has no sequence parallelism yet)",
}
# what transformers names the stacked expert weights of a moe_tp_experts module: fxshard reads the same splits off
# the grouped matmuls (fxshard/plan/experts.py), so these entries add nothing
_EXPERT_WEIGHT_STYLES = {"packed_colwise", "packed_rowwise", "colwise", "rowwise"}
_BARE_PARAMETER = ("bare parameters stay whole on every tp rank (fxshard splits the Linear/Conv1D/Embedding ops "
                   "of modules; other tensors are placed by propagation)")


def hf_style(name: str) -> Style | str | None:
    """What fxshard makes of a transformers style: a :class:`Style`, ``None`` (implied by the split,
    nothing to attach), or a sentence saying what fxshard does instead.  ``KeyError`` for a style this
    version has not seen.

    >>> hf_style("rowwise_split_input")
    Style(kind='rowwise', packed=1, gather_output=False)
    """
    if name in _HF_STYLES:
        return _HF_STYLES[name]
    if name in _HF_IMPLIED:
        return None
    return _HF_INSTEAD[name]


def as_style(value, where: str) -> Style:
    if isinstance(value, Style):
        return value
    if isinstance(value, str) and value in _HF_STYLES:
        return _HF_STYLES[value]
    raise PlanError(
        f"{where}: {value!r} is not a parallel style; use fxshard.colwise(), fxshard.rowwise(), "
        f"fxshard.vocab_parallel(), fxshard.replicate(), fxshard.moe_tp_experts() or one of {sorted(_HF_STYLES)}"
    )


PLAN_ATTR = "__fxshard_plan__"


def parallelize(target=None, /, **styles: Style):
    """Attach styles to the children of a module class or instance.

    As a class decorator::

        @fxshard.parallelize(fc_in=fxshard.colwise(), fc_out=fxshard.rowwise())
        class MLP(nn.Module): ...

    On an instance (e.g. inside ``make_model``)::

        fxshard.parallelize(model.blocks[0].mlp, fc_in=fxshard.colwise(), fc_out=fxshard.rowwise())

    Keys are child paths relative to the module (``"attn.qkv"``, globs allowed); use ``__self__``
    for the module itself.
    """
    for key, value in styles.items():
        as_style(value, f"fxshard.parallelize({key}=...)")

    def attach(obj):
        plan = dict(obj.__dict__.get(PLAN_ATTR, {}))
        plan.update({"" if k == "__self__" else k: v for k, v in styles.items()})
        setattr(obj, PLAN_ATTR, plan)
        return obj

    if target is None:
        return attach
    if isinstance(target, (type, torch.nn.Module)):
        return attach(target)
    raise PlanError(f"fxshard.parallelize expects a module class or instance, got {type(target).__name__}")


def glob_match(pattern: str, fqn: str) -> bool:
    """Component-wise glob: ``layers.*.mlp`` matches ``layers.3.mlp`` but not ``layers.3.x.mlp``."""
    p, f = pattern.split(".") if pattern else [], fqn.split(".") if fqn else []
    return len(p) == len(f) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, f, strict=True))


@dataclass
class ResolvedPlan:
    """Style per module FQN, and where it came from (for the generated header and errors)."""

    styles: dict[str, Style] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    source: str = "none"
    warnings: list[str] = field(default_factory=list)  # the user's mistakes (a key matching nothing)
    notes: list[str] = field(default_factory=list)  # what fxshard does with the model's own plan, where it differs

    def describe(self) -> list[str]:
        return [f"{fqn}: {self.styles[fqn]}  [{self.sources[fqn]}]" for fqn in sorted(self.styles, key=_natural)]


def _natural(fqn: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in fqn.split(".")]


def _assign(pattern: str, style: Style, modules: list[str], source: str, resolved: ResolvedPlan) -> bool:
    """Give ``style`` to the modules ``pattern`` matches that no higher-priority source styled; False if none."""
    hits = [m for m in modules if glob_match(pattern, m)]
    for m in hits:
        if m not in resolved.styles:
            resolved.styles[m] = style
            resolved.sources[m] = source
    return bool(hits)


def _apply(entries: dict, modules: list[str], source: str, resolved: ResolvedPlan) -> None:
    for key, value in entries.items():
        style = as_style(value, f"{source} plan key {key!r}")
        if not _assign(key, style, modules, source, resolved):
            example = modules[1] if len(modules) > 1 else "..."
            resolved.warnings.append(f"{source} plan key {key!r} matches no module of the model; check the path "
                                     f"(modules look like {example!r})")


_UNKNOWN = "styles this version of fxshard does not know: those modules stay whole on every tp rank"


def _apply_shipped(model: torch.nn.Module, modules: list[str], resolved: ResolvedPlan) -> None:
    """The model's own plans, which are not the user's to fix: what fxshard cannot follow is said in one
    note (grouped by what it does instead), never as warnings."""
    tp_plan, ep_plan = hf_plan(model), hf_plan(model, "ep")
    params = [name for name, _ in model.named_parameters()]
    experts = {k for k, v in tp_plan.items() if _HF_INSTEAD.get(v) == _EXPERTS}
    split_experts = {k for k, v in tp_plan.items() if v == "moe_tp_experts"}  # their weights' entries are implied
    instead: dict[str, dict[str, list[str]]] = {}  # what fxshard does -> plan key -> styles
    unmatched = []
    entries = [(k, v, False) for k, v in tp_plan.items()] + [(k, v, True) for k, v in ep_plan.items()]
    for key, name, expert_parallel in entries:
        what = _EP_PLAN if expert_parallel else hf_style(name) if _known(name) else _UNKNOWN
        if not expert_parallel and key.rsplit(".", 1)[0] in split_experts and name in _EXPERT_WEIGHT_STYLES:
            continue  # e.g. experts.gate_up_proj packed_colwise: the split moe_tp_experts derives from the graph
        if isinstance(what, Style):
            if _assign(key, what, modules, "model", resolved):
                continue
            if not any(glob_match(key, p) for p in params):
                unmatched.append(key)  # e.g. dense-MLP keys of a model whose layers are all MoE
                continue
            what = _EXPERTS if key.rsplit(".", 1)[0] in experts else _BARE_PARAMETER
        if what is not None:
            styles = instead.setdefault(what, {}).setdefault(key, [])
            styles.extend([name] if name not in styles else [])
    clauses = [f"{what}: " + ", ".join(f"{k} ({', '.join(v)})" for k, v in keys.items())
               for what, keys in instead.items()]
    if unmatched:
        clauses.append(f"{len(unmatched)} entr{'y matches' if len(unmatched) == 1 else 'ies match'} no module of "
                       f"this configuration and {'is' if len(unmatched) == 1 else 'are'} skipped: "
                       + ", ".join(unmatched))
    if clauses:
        resolved.notes.append(f"{type(model).__name__}'s own parallel plan: " + "; ".join(clauses))


def _known(name: str) -> bool:
    return name in _HF_STYLES or name in _HF_IMPLIED or name in _HF_INSTEAD


def decorator_plan(model: torch.nn.Module) -> dict[str, Style]:
    """Entries from ``fxshard.parallelize`` on module instances (first) and classes, as absolute globs."""
    out: dict[str, Style] = {}
    for fqn, mod in model.named_modules():
        entries = dict(getattr(type(mod), PLAN_ATTR, {}))
        entries.update(mod.__dict__.get(PLAN_ATTR, {}))
        for key, style in entries.items():
            out.setdefault(f"{fqn}.{key}" if fqn and key else (fqn or key), style)
    return out


def hf_plan(model: torch.nn.Module, kind: str = "tp") -> dict[str, str]:
    """The tensor-parallel (``kind="ep"``: expert-parallel) plan a Hugging Face model ships, with keys
    relative to the model root."""
    plan = getattr(model, f"_{kind}_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, f"base_model_{kind}_plan", None) if config is not None else None
    if not base:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    has_prefix = prefix and hasattr(model, prefix)
    return {(f"{prefix}.{k}" if has_prefix else k): v for k, v in base.items()}


def resolve(model: torch.nn.Module, user_plan: dict | None) -> ResolvedPlan:
    """Merge the plan sources in priority order; an empty result means 'plan automatically'.

    Mistakes in the user's plan or decorators (a key matching nothing) are in ``warnings``; what fxshard
    does differently from the model's own plan is in ``notes``.  A peft model's plan names its base model's modules
    (a LoRA layer by the name of the linear it wraps), as the same plan does without the adapters."""
    from fxshard.capture.lora import peft_base

    base, prefix = peft_base(model)
    if prefix:
        inner = resolve(base, user_plan)
        return dataclasses.replace(inner, styles={prefix + k: v for k, v in inner.styles.items()},
                                   sources={prefix + k: v for k, v in inner.sources.items()})
    modules = [fqn for fqn, _ in model.named_modules()]
    resolved = ResolvedPlan()
    if user_plan:
        _apply(user_plan, modules, "user", resolved)
    deco = decorator_plan(model)
    if deco:
        _apply(deco, modules, "decorator", resolved)
    _apply_shipped(model, modules, resolved)
    used = [s for s in ("user", "decorator", "model") if s in resolved.sources.values()]
    resolved.source = "+".join(used) if used else "auto"
    return resolved
