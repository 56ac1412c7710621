"""Which checkpoint tensors make each model tensor, by transformers' own conversion table for the model type.

transformers 5 models hold a mixture-of-experts layer's experts stacked (``mlp.experts.gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``), while hub checkpoints, and ``save_pretrained``, store one tensor per expert (Qwen3-MoE
``mlp.experts.3.gate_proj.weight [I, H]``, Mixtral ``block_sparse_moe.experts.3.w1.weight``).  ``from_pretrained``
converts with a table per model type (``transformers.conversion_mapping``): renamings, then at most one converter
per tensor, whose operations stack the experts (``MergeModulelist``) and join gate and up (``Concatenate``).  Here
the same table runs over the checkpoint's tensor *names*, reading no tensor, and each model tensor it builds from
several is described as :class:`Piece` s: which checkpoint tensor lies where inside it, so a rank can read just
the parts of the pieces its slice covers (:func:`fxshard.runtime.slices.read_slice`)::

    names = hub_names(model, ["model.layers.0.mlp.experts.0.gate_proj.weight", ...], shapes)
    names["model.layers.0.mlp.experts.gate_up_proj"][E]   # Piece('...experts.0.up_proj.weight', (I, H), (0, I, 0), 0)
    names["model.layers.0.mlp.gate.weight"]                # a plain rename: the checkpoint's name (Mixtral's
                                                            # 'model.layers.0.block_sparse_moe.gate.weight')
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fxshard.errors import WeightsError


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor inside a model tensor: it fills ``start[d] : start[d] + shape`` of every dimension
    ``d`` but ``stack``, where it is the single index ``start[stack]`` (stacked experts: ``stack`` 0)."""

    name: str
    shape: tuple[int, ...]  # its own, as the model's configuration gives it
    start: tuple[int, ...]
    stack: int


def hub_names(model, names, shapes: dict[str, tuple[int, ...]]) -> dict[str, str | tuple[Piece, ...]]:
    """Model tensor name -> the checkpoint tensor it is read from under another name, or the pieces it is built from.

    Only names transformers renames or converts appear; none for a model without a conversion table (or not a
    ``PreTrainedModel``).  ``shapes``: model tensor name -> shape.  Raises :class:`WeightsError` for a conversion
    that cannot be read by slice, and for experts missing from the checkpoint, naming the tensor."""
    table = _conversions(model)
    if not table:
        return {}
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_renamings,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [t for t in table if isinstance(t, WeightRenaming)]
    converters = [t for t in table if isinstance(t, WeightConverter)]
    known = dict.fromkeys(shapes, True)
    prefix = getattr(model, "base_model_prefix", None)
    found: dict[str, str | dict] = {}
    for key in sorted(names, key=dot_natural_key):  # transformers' order: the n-th expert key is expert n
        target, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if target not in known or target == key:
            continue
        if pattern is None:
            found[target] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        groups = found.setdefault(target, {"converter": converter, "keys": {}})
        groups["keys"].setdefault(pattern, []).append((key, apply_renamings(key, renamings)))
    return {target: got if isinstance(got, str) else _pieces(target, shapes[target], got)
            for target, got in found.items()}


def hub_sources(model, name: str) -> list[str]:
    """The checkpoint name patterns transformers' table builds model tensor ``name`` from (none if it is read as
    itself): what a message about a missing tensor can offer besides its own name::

        hub_sources(qwen3_moe, "model.layers.1.mlp.experts.gate_up_proj")
        # ['mlp.experts.*.gate_proj.weight', 'mlp.experts.*.up_proj.weight']
    """
    from transformers.core_model_loading import WeightConverter

    return [pattern for c in _conversions(model) if isinstance(c, WeightConverter)
            and any(re.search(re.escape(t) + "$", name) for t in c.target_patterns) for pattern in c.source_patterns]


def _conversions(model) -> list:
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # another transformers: no table to follow; stacked checkpoints still load by name
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return get_model_conversion_mapping(model)  # with the legacy renamings (LayerNorm.gamma), as from_pretrained


def _pieces(target: str, shape: tuple[int, ...], got: dict) -> tuple[Piece, ...]:
    """The pieces of ``target``: each source pattern's keys stacked along ``stack``, the patterns joined along
    ``cat``."""
    converter = got["converter"]
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if not ops or ops[0][0] != "MergeModulelist" or any(n != "Concatenate" for n, _ in ops[1:2]) or len(ops) > 2:
        raise WeightsError(
            f"tensor {target}: transformers builds it from {converter.source_patterns} with "
            f"{' then '.join(n for n, _ in ops)}, which --weights cannot read by slice (it reads experts stacked "
            "with MergeModulelist, then joined with Concatenate); build make_model() with from_pretrained and "
            "compile without --weights")
    stack = ops[0][1]
    cat = ops[1][1] if len(ops) > 1 else None
    patterns = converter.source_patterns
    count = shape[stack] // len(patterns) if cat == stack else shape[stack]
    share = shape[cat] // len(patterns) if cat is not None and cat != stack else 0
    own = [n for d, n in enumerate(shape) if d != stack]
    if share:
        own[cat if cat < stack else cat - 1] = share
    pieces = []
    for j, pattern in enumerate(patterns):
        keys = _by_expert(target, pattern, got["keys"].get(pattern, []), count)
        for e, key in enumerate(keys):
            start = [0] * len(shape)
            start[stack] = e + (j * count if cat == stack else 0)
            if cat is not None and cat != stack:
                start[cat] = j * share
            pieces.append(Piece(key, tuple(own), tuple(start), stack))
    return tuple(pieces)


def _by_expert(target: str, pattern: str, keys: list[tuple[str, str]], count: int) -> list[str]:
    """The checkpoint keys of ``pattern`` in expert order, ``count`` of them, or an error naming a missing one."""
    try:  # transformers reads a source pattern as a regular expression whose ``*`` stands for the expert index
        index = re.compile(pattern.replace("*", r"(\d+)"))
    except re.error:
        index = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
    numbered = {}
    for key, renamed in keys:
        match = index.search(renamed)
        e = int(match.group(1)) if match else len(numbered)
        numbered[e] = key, renamed, match
    missing = [e for e in range(count) if e not in numbered]
    fix = ("the checkpoint is incomplete (re-save it with save_pretrained, or restore the missing file), or of a "
           "model with another number of experts")
    if missing:
        name = _expert_name(next(iter(numbered.values())), missing[0]) if numbered else pattern
        more = f" (and {len(missing) - 1} more of its {count} experts)" if len(missing) > 1 else ""
        raise WeightsError(f"tensor {name} is missing from the checkpoint{more}: the model's {target} stacks {count} "
                           f"experts, one checkpoint tensor each ({pattern!r}); {fix}")
    if len(numbered) != count:
        extra = sorted(e for e in numbered if e >= count)
        raise WeightsError(f"tensor {numbered[extra[0]][0]}: the model's {target} stacks {count} experts (0 to "
                           f"{count - 1}), the checkpoint holds {len(numbered)}; {fix}")
    return [numbered[e][0] for e in range(count)]


def _expert_name(sibling: tuple[str, str, re.Match | None], e: int) -> str:
    """The checkpoint name expert ``e`` would have: a sibling expert's key with its expert number replaced."""
    key, renamed, match = sibling
    if match is None:
        return f"expert {e}"
    nth = sum(1 for part in renamed[:match.start(1)].split(".") if part.isdigit())
    parts, seen = key.split("."), 0
    for i, part in enumerate(parts):
        if part.isdigit():
            if seen == nth:
                parts[i] = str(e)
                return ".".join(parts)
            seen += 1
    return f"expert {e}"
