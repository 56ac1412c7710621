"""fxshard: compile an unmodified PyTorch model into readable per-rank distributed training code."""

from fxshard.errors import FxshardError
from fxshard.version import __version__

# The public names below load the compiler when first used, not when a rank file imports
# ``fxshard.runtime`` (which must run with torch and the runtime alone).
_LAZY = {
    "pipeline_split": "fxshard.ir.cut",
    "load": "fxshard.train.program",
    **{name: "fxshard.plan.styles" for name in ("colwise", "rowwise", "vocab_parallel", "replicate", "moe_tp_experts",
                                                "parallelize")},
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxshard' has no attribute {name!r}")


def compile(model_file, out=None, *, plan=None, seed: int = 0, weights=None, meta: bool = False, seq=None,
            batch=None, task=None, trust_remote_code: bool = False, **layout):
    """Compile a model file, or a Hugging Face folder, for a layout and write the per-rank program to ``out``.

    >>> result = fxshard.compile("samples/gpt.py", "out/gpt-tp2", tp=2)
    >>> result.files, result.ctx.layout.world_size
    (['rank_pp0_tp0.py', 'rank_pp0_tp1.py'], 2)

    A Hugging Face folder (one ``save_pretrained`` wrote) is compiled as it is:
    ``fxshard.compile("qwen-hf", "out/qwen", tp=2, seq=1024, batch=8, lora=16)``.

    ``layout``: the fields of :class:`fxshard.ir.context.Layout` by name (``tp``, ``pp``, ``dp``, ``zero``,
    ``schedule``, ``lora``, ...).  ``weights``: a Hugging Face folder each rank reads its slices from at run time
    (captured on meta tensors); ``meta=True``: capture on meta tensors and write code and manifest only.
    ``model_file`` a Hugging Face folder (``config.json``): ``seq``, ``batch``, ``task`` and ``trust_remote_code``
    are ``fxshard compile FOLDER``'s flags of those names (docs/fine-tuning.md); the folder is its own weights.
    """
    from pathlib import Path

    from fxshard.capture.folder_options import FolderOptions
    from fxshard.capture.hf_folder import check_model_flags
    from fxshard.driver import compile as _compile
    from fxshard.driver import model_source
    from fxshard.ir.context import Layout

    layout = Layout(**layout)
    folder = FolderOptions(task=task, trust_remote_code=trust_remote_code)
    check_model_flags(Path(model_file), seq, batch, False, weights=None if weights is None else Path(weights))
    with model_source(model_file, folder, seq, batch, weights=not meta) as source:
        return _compile(source.model_file, layout, out=out, plan=plan, seed=seed, weights=source.weights or weights,
                        meta=meta)


__all__ = ["FxshardError", "colwise", "rowwise", "vocab_parallel", "replicate", "moe_tp_experts", "parallelize",
           "pipeline_split", "compile",
           "load",
           "__version__"]
