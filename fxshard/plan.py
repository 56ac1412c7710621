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
Megatron pairing (``fxshard/autoplan.py``).  Keys are globs over dotted path components
(``*`` matches one component); a key that matches no module is a warning naming it.
"""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field

import torch

from fxshard.errors import PlanError


@dataclass(frozen=True)
class Style:
    """How one module's weights are split over the tensor-parallel axis."""

    kind: str  # "colwise" | "rowwise" | "vocab" | "replicate"
    packed: int = 1  # colwise only: number of packed blocks (fused q/k/v = 3); 0 = infer from the split
    gather_output: bool = False  # colwise only: all-gather the output (an output head before the loss)

    def __post_init__(self):
        if self.kind not in ("colwise", "rowwise", "vocab", "replicate"):
            raise PlanError(f"unknown parallel style {self.kind!r}; use colwise, rowwise, vocab or replicate")

    def __str__(self) -> str:
        opts = []
        if self.packed != 1:
            opts.append(f"packed={self.packed}")
        if self.gather_output:
            opts.append("gather_output=True")
        return f"{self.kind}({', '.join(opts)})"

    @property
    def role(self) -> str:
        return {"colwise": "column-parallel", "rowwise": "row-parallel", "vocab": "vocab-parallel",
                "replicate": "replicated"}[self.kind]


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


_HF_STYLES = {
    "colwise": colwise(),
    "rowwise": rowwise(),
    "colwise_gather_output": colwise(gather_output=True),
    "colwise_rep": colwise(gather_output=True),
    "packed_colwise": colwise(packed=0),
    "embedding_rowwise": vocab_parallel(),
    "vocab": vocab_parallel(),
    "replicate": replicate(),
    "replicated_with_grad_allreduce": replicate(),
}


def as_style(value, where: str) -> Style:
    if isinstance(value, Style):
        return value
    if isinstance(value, str) and value in _HF_STYLES:
        return _HF_STYLES[value]
    raise PlanError(
        f"{where}: {value!r} is not a parallel style; use fxshard.colwise(), fxshard.rowwise(), "
        f"fxshard.vocab_parallel(), fxshard.replicate() or one of {sorted(_HF_STYLES)}"
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
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> list[str]:
        return [f"{fqn}: {self.styles[fqn]}  [{self.sources[fqn]}]" for fqn in sorted(self.styles, key=_natural)]


def _natural(fqn: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in fqn.split(".")]


def _apply(entries: dict, modules: list[str], source: str, resolved: ResolvedPlan, prefix: str = "") -> None:
    for key, value in entries.items():
        try:
            style = as_style(value, f"{source} plan key {key!r}")
        except PlanError as e:
            if source != "model":
                raise
            # a shipped plan may use styles fxshard does not implement (experts, ...): say so, keep going
            resolved.warnings.append(f"{e}; that entry of the model's own plan is ignored")
            warnings.warn(resolved.warnings[-1], stacklevel=3)
            continue
        pattern = f"{prefix}.{key}" if prefix and key else (prefix or key)
        hits = [m for m in modules if glob_match(pattern, m)]
        if not hits:
            msg = f"{source} plan key {pattern!r} matches no module of the model; check the path (modules look like {modules[1] if len(modules) > 1 else '...'!r})"
            resolved.warnings.append(msg)
            warnings.warn(msg, stacklevel=3)
        for m in hits:
            if m not in resolved.styles:  # higher-priority sources were applied first
                resolved.styles[m] = style
                resolved.sources[m] = source


def decorator_plan(model: torch.nn.Module) -> dict[str, Style]:
    """Entries from ``fxshard.parallelize`` on module instances (first) and classes, as absolute globs."""
    out: dict[str, Style] = {}
    for fqn, mod in model.named_modules():
        entries = dict(getattr(type(mod), PLAN_ATTR, {}))
        entries.update(mod.__dict__.get(PLAN_ATTR, {}))
        for key, style in entries.items():
            out.setdefault(f"{fqn}.{key}" if fqn and key else (fqn or key), style)
    return out


def hf_plan(model: torch.nn.Module) -> dict[str, str]:
    """The tensor-parallel plan a Hugging Face model ships, with keys relative to the model root."""
    plan = getattr(model, "_tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not base:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    has_prefix = prefix and hasattr(model, prefix)
    return {(f"{prefix}.{k}" if has_prefix else k): v for k, v in base.items()}


def resolve(model: torch.nn.Module, user_plan: dict | None) -> ResolvedPlan:
    """Merge the plan sources in priority order; an empty result means 'plan automatically'."""
    modules = [fqn for fqn, _ in model.named_modules()]
    resolved = ResolvedPlan()
    if user_plan:
        _apply(user_plan, modules, "user", resolved)
    deco = decorator_plan(model)
    if deco:
        _apply(deco, modules, "decorator", resolved)
    shipped = hf_plan(model)
    if shipped:
        _apply(shipped, modules, "model", resolved)
    used = [s for s in ("user", "decorator", "model") if s in resolved.sources.values()]
    resolved.source = "+".join(used) if used else "auto"
    return resolved
