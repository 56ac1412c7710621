"""LoRA adapters on the user's model, made by peft before capture: ``compile --lora R`` and a peft model alike.

``--lora 16 --lora-alpha 32 --lora-targets q_proj,v_proj`` wraps the model ``make_model()`` returns with peft's own
``get_peft_model(model, LoraConfig(...))``, so the captured graph is the one a peft-wrapped model file gives: each
targeted linear ``W`` becomes ``W.base_layer`` (frozen) plus ``scaling * W.lora_B.default(W.lora_A.default(x))``, and
every other parameter is frozen (``requires_grad=False``: no gradient, no optimizer state).  The parameters keep
peft's names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``), so checkpoints and
``export --peft`` speak peft's language.  Where the adapters go over tp is :mod:`fxshard.plan.lora`'s::

    options = LoraOptions(rank=16, alpha=32, targets=("q_proj", "v_proj"))
    model = apply_lora(make_model(), options, seed=0, where="llama.py")   # a peft.PeftModel

A target is a module name or a glob matched against the end of each module path, component by component
(``q_proj`` matches ``model.layers.3.self_attn.q_proj``, as peft's ``target_modules`` does; ``layers.0.*.q_proj``
only the first layer's); every target must match a module, and each matched module must be one peft adapts.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch

from fxshard.errors import FxshardError

PEFT_PIN = "peft==0.21.2"  # pyproject's lora extra
DEFAULT_ALPHA = 8.0  # peft's LoraConfig default
ADAPTER_SEED = 3  # the adapters are drawn from seed + this, whatever the base's build drew (real or meta)
BASE_PREFIX = "base_model.model."  # what peft puts before the base model's names


class LoraError(FxshardError):
    """LoRA options that do not fit the model (targets matching nothing, a module peft cannot adapt)."""


@dataclass(frozen=True)
class LoraOptions:
    """The adapters ``--lora`` asks for (the Layout's lora fields)::

        LoraOptions.from_layout(Layout(lora=16, lora_targets="q_proj,v_proj")).targets   # ('q_proj', 'v_proj')
    """

    rank: int
    alpha: float = DEFAULT_ALPHA
    targets: tuple[str, ...] | None = None  # None: peft's default list for the model type
    dropout: float = 0.0

    @classmethod
    def from_layout(cls, layout) -> LoraOptions | None:
        if getattr(layout, "lora", None) is None:
            return None
        targets = None if layout.lora_targets is None else \
            tuple(t.strip() for t in layout.lora_targets.split(",") if t.strip())
        return cls(layout.lora, DEFAULT_ALPHA if layout.lora_alpha is None else float(layout.lora_alpha), targets,
                   layout.lora_dropout or 0.0)


def require_peft():
    """peft, or a :class:`LoraError` saying how to install it (an optional extra)."""
    try:
        import peft
    except ImportError as e:
        raise LoraError(f"LoRA needs peft, which is not installed: pip install '{PEFT_PIN}' (or fxshard[lora])") from e
    return peft


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft wrapper (without importing peft where nothing loaded it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module FQN -> peft LoRA layer (the wrapper holding ``base_layer``, ``lora_A``, ``lora_B``), in model order."""
    tuners = sys.modules.get("peft.tuners.lora")
    if tuners is None:
        return {}
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, tuners.LoraLayer)}


def target_pattern(target: str) -> str:
    """The regular expression of one target, as peft's ``re.fullmatch`` reads a string ``target_modules``: the
    target's dotted components matched against the last components of a module path, ``*`` and ``?`` within one
    component::

        >>> bool(re.fullmatch(target_pattern("layers.*.q_proj"), "model.layers.3.q_proj"))
        True
    """
    parts = [re.escape(p).replace(r"\*", "[^.]*").replace(r"\?", "[^.]") for p in target.split(".")]
    return r"(?:.*\.)?" + r"\.".join(parts)


def _adaptable(module: torch.nn.Module) -> bool:
    """A module peft's LoRA adapts (Linear, GPT-2's Conv1D, Embedding, convolutions)."""
    names = {"Linear", "Conv1D", "Embedding", "Conv1d", "Conv2d", "Conv3d"}
    return type(module).__name__ in names or any(c.__name__ in names for c in type(module).__mro__[1:2])


def matched_modules(model: torch.nn.Module, targets: tuple[str, ...], where: str) -> list[str]:
    """The module paths ``targets`` match; a target matching none, or a match peft cannot adapt, is refused naming
    the targets and the names the model's adaptable modules have."""
    modules = dict(model.named_modules())
    found: dict[str, list[str]] = {t: [n for n in modules if n and re.fullmatch(target_pattern(t), n)]
                                   for t in targets}
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if n and _adaptable(m)})
    empty = [t for t, hits in found.items() if not hits]
    if empty:
        raise LoraError(f"{where}: --lora-targets {','.join(empty)} match{'es' * (len(empty) == 1)} no module of "
                        f"{type(model).__name__}; expected module names or globs matched against the end of each "
                        f"module path; its linears and embeddings are named {', '.join(leaves) or '(none)'}")
    hits = sorted({n for names in found.values() for n in names}, key=list(modules).index)
    wrong = [n for n in hits if not _adaptable(modules[n])]
    if wrong:
        raise LoraError(f"{where}: --lora-targets match {wrong[0]} ({type(modules[wrong[0]]).__name__}), which is not "
                        "a layer LoRA adapts (Linear, Conv1D, Embedding); name its linears instead, e.g. "
                        f"{', '.join(leaves[:4])}")
    return hits


def _config(model: torch.nn.Module, options: LoraOptions, where: str):
    peft = require_peft()
    targets = options.targets
    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        default = peft.utils.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
        if default is None:
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and _adaptable(m)})
            raise LoraError(f"{where}: --lora without --lora-targets takes peft's default targets for the model "
                            f"type, and peft has none for {model_type or type(model).__name__}; give --lora-targets "
                            f"(its linears and embeddings are named {', '.join(leaves) or '(none)'})")
        targets = tuple(default)
    modules = dict(model.named_modules())
    conv1d = any(type(modules[n]).__name__ == "Conv1D" for n in matched_modules(model, targets, where))
    globbed = any(c in t for t in targets for c in "*?")
    target_modules = "|".join(f"(?:{target_pattern(t)})" for t in targets) if globbed else list(targets)
    return peft.LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=options.dropout,
                           target_modules=target_modules, bias="none", fan_in_fan_out=conv1d)


def apply_lora(model: torch.nn.Module, options: LoraOptions, seed: int, where: str) -> torch.nn.Module:
    """``model`` wrapped by peft's LoRA as ``options`` say, its adapters drawn from ``seed`` (:func:`draw_adapters`)."""
    if is_peft_model(model):
        raise LoraError(f"{where}: make_model() returns a peft model already, and --lora would wrap it again; drop "
                        "--lora (its adapters are compiled as they are) or return the base model")
    peft = require_peft()
    config = _config(model, options, where)
    try:
        wrapped = peft.get_peft_model(model, config)
    except (ValueError, TypeError, RuntimeError) as e:  # peft's own refusal of a module or an option
        raise LoraError(f"{where}: peft refused the LoRA configuration: {e}") from e
    draw_adapters(wrapped, seed)
    return wrapped


def draw_adapters(model: torch.nn.Module, seed: int) -> None:
    """Draw every adapter again, in module order, from ``seed``, as peft initializes them (A Kaiming-uniform, B
    zeros): real tensors even where the base was built on meta (peft puts adapters on their base's device), and the
    same values from a real build and a meta one, whose bases draw nothing."""
    torch.manual_seed(seed + ADAPTER_SEED)
    for layer in lora_modules(model).values():
        for name in list(layer.lora_A):
            for table in (layer.lora_A, layer.lora_B):
                if any(p.is_meta for p in table[name].parameters()):
                    table[name] = table[name].to_empty(device="cpu")
            layer.reset_lora_parameters(name, True)


def base_name(fqn: str) -> str | None:
    """The base model's name of a peft model's tensor (``base_model.model.X.base_layer.weight`` -> ``X.weight``),
    None for an adapter's (``...lora_A.default.weight``)."""
    if not fqn.startswith(BASE_PREFIX):
        return fqn
    name = fqn[len(BASE_PREFIX):]
    if re.search(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.", name + "."):
        return None
    return name.replace(".base_layer.", ".")


def peft_base(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The model a peft wrapper adapts and the prefix of its names in the wrapper (``model, ""`` for any other
    model): plans name the base model's modules, with or without ``--lora``."""
    if is_peft_model(model):
        return model.base_model.model, BASE_PREFIX
    return model, ""
