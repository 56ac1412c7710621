"""Custom operators a captured graph calls, and the Python module that registers each.

A model may run ops outside ATen (Hugging Face MoE experts call ``torch.ops.transformers.grouped_mm_fallback``,
which ``transformers.integrations.moe`` registers on import).  ``torch.ops.<namespace>.<name>`` exists
only once that module ran, so a rank file imports it explicitly (with a comment naming the op): it then
runs wherever it is loaded — ``fxshard check``, ``run`` and its workers, ``verify``, ``export`` — with
nothing else imported first.  The manifest lists the same map (``custom_ops``)::

    custom_op_modules(program.gm)  # {"transformers::grouped_mm_fallback": "transformers.integrations.moe"}
"""

from __future__ import annotations

import sys

import torch
import torch.fx as fx

from fxshard.errors import CaptureError
from fxshard.graph import node_fqn

# fxshard_fn: custom autograd.Functions, which each rank file defines itself (functions.py)
BUILTIN = {"aten", "prims", "fxshard", "fxshard_fn", "higher_order", "_c10d_functional", "c10d_functional", "_dtensor"}
MODEL_FILE_MODULE = "fxshard_model_"  # modelfile.load_model_file's module names


def custom_op_modules(gm: fx.GraphModule) -> dict[str, str]:
    """``namespace::name`` -> importable module registering it, for every non-builtin op ``gm`` calls."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.namespace in BUILTIN:
            continue
        qualname = op._schema.name
        if qualname in found:
            continue
        module = registering_module(op)
        where = f"{node_fqn(node) or 'the model'} calls torch.ops.{qualname.replace('::', '.')}"
        if module is None:
            raise CaptureError(f"{where}, a custom op fxshard cannot trace to the Python module that registers it "
                               "(expected torch.library.custom_op); the rank files must import that module to "
                               "run: register the op with torch.library.custom_op in an importable module")
        if module.startswith(MODEL_FILE_MODULE) or module == "__main__":
            raise CaptureError(f"{where}, registered by the model file itself; rank files run without the model "
                               "file, so they could not find the op: move its torch.library.custom_op "
                               "registration into a module the model file imports")
        found[qualname] = module
    return dict(sorted(found.items()))


def registering_module(op: torch._ops.OpOverload) -> str | None:
    """The module whose import registers ``op`` (its Python implementation's module), or None."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(op._schema.name)
    fn = getattr(opdef, "_init_fn", None)
    module = getattr(fn, "__module__", None)
    if module is None or module not in sys.modules:
        return None
    return module


def import_lines(ops: dict[str, str]) -> list[str]:
    """The rank file's imports: one per module, commented with the ops it registers."""
    by_module: dict[str, list[str]] = {}
    for qualname, module in ops.items():
        by_module.setdefault(module, []).append("torch.ops." + qualname.replace("::", "."))
    return [f"import {m}  # noqa: F401  registers {', '.join(names)}" for m, names in sorted(by_module.items())]
