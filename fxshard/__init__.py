"""fxshard: compile an unmodified PyTorch model into readable per-rank distributed training code."""

from fxshard.errors import FxshardError
from fxshard.version import __version__

# The public names below load the compiler when first used, not when a rank file imports
# ``fxshard.runtime`` (which must run with torch and the runtime alone).
_LAZY = {
    "pipeline_split": "fxshard.ir.cut",
    "load": "fxshard.train.program",
    **{name: "fxshard.plan.styles" for name in ("colwise", "rowwise", "vocab_parallel", "replicate", "moe_tp_experts", "parallelize")},
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxshard' has no attribute {name!r}")


def compile(model_file, out=None, *, plan=None, seed: int = 0, weights=None, meta: bool = False, **layout):
    """Compile a model file for a layout and write the per-rank program to ``out``.

    >>> result = fxshard.compile("samples/gpt.py", "out/gpt-tp2", tp=2)
    >>> result.files, result.ctx.layout.world_size
    (['rank_pp0_tp0.py', 'rank_pp0_tp1.py'], 2)

    ``layout``: the fields of :class:`fxshard.ir.context.Layout` by name (``tp``, ``pp``, ``dp``, ``zero``,
    ``schedule``, ...).  ``weights``: a Hugging Face folder each rank reads its slices from at run time
    (captured on meta tensors); ``meta=True``: capture on meta tensors and write code and manifest only.
    """
    from fxshard.driver import compile as _compile
    from fxshard.ir.context import Layout

    return _compile(model_file, Layout(**layout), out=out, plan=plan, seed=seed, weights=weights, meta=meta)


__all__ = ["FxshardError", "colwise", "rowwise", "vocab_parallel", "replicate", "moe_tp_experts", "parallelize", "pipeline_split", "compile",
           "load",
           "__version__"]
