"""A custom ``torch.autograd.Function`` as a custom op whose backward is the Function's own.

torch.export keeps only the operations of a Function's ``forward``: autograd would then differentiate
those, not run the Function's ``backward`` (Bloom's tanh-GeLU, Phimoe's router multiplier, any
straight-through estimator).  Capture therefore replaces each ``Fn.apply(...)`` by one call of an op of
the ``fxshard_fn`` namespace defined here, and every rank file defines the same op when it is loaded::

    # custom autograd.Functions the model applies, each one op whose backward is the Function's own
    rt.autograd_function("GeLUFunction_5d0c2a81", "transformers.models.bloom.modeling_bloom", "GeLUFunction",
                         (rt.TENSOR,), outputs=1, pointwise=True)

The op's forward runs ``Fn.apply`` on its tensors, the non-tensor arguments (``template``: ``TENSOR`` marks
where each tensor goes) fixed in the op.  Its backward recomputes ``Fn.apply`` on the saved inputs under
``enable_grad`` and takes ``torch.autograd.grad`` with the incoming gradients: the Function's ``backward``
runs on the ``ctx`` of a forward over the same values, and ``needs_input_grad`` is the op's own.  The cost
is one more run of the Function's forward per backward.  Capture only wraps a Function whose forward draws
no random numbers, so the recomputation is the forward that ran.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence

import torch

NAMESPACE = "fxshard_fn"


class _Tensor:
    """Where a tensor argument goes in a Function's argument list (``template``)."""

    def __repr__(self) -> str:
        return "rt.TENSOR"


TENSOR = _Tensor()
_DEFINED: dict[str, torch._ops.OpOverload] = {}


def op_name(module: str, qualname: str, template: Sequence, outputs: int) -> str:
    """The op's name: the Function's name and a digest of where it lives and how it is called."""
    key = repr((module, qualname, tuple(template), outputs)).encode()
    return f"{qualname.replace('.', '_')}_{hashlib.sha256(key).hexdigest()[:8]}"


def resolve(module: str, qualname: str) -> type:
    """The Function class ``module.qualname`` (imported)."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def autograd_function(name: str, module: str, qualname: str, template: Sequence, outputs: int,
                      pointwise: bool = False) -> torch._ops.OpOverload:
    """Define ``torch.ops.fxshard_fn.<name>`` for the Function ``module.qualname`` called with ``template``
    (its arguments, ``TENSOR`` where a tensor goes) returning ``outputs`` tensors (0: one tensor, not a tuple).
    ``pointwise``: capture proved forward and backward elementwise (tags the op, giving it the pointwise
    sharding rule).  Defining it again returns the op defined first."""
    if name in _DEFINED:
        return _DEFINED[name]
    fn = resolve(module, qualname)
    slots = sum(1 for t in template if t is TENSOR)
    params = ", ".join(f"Tensor t{i}" for i in range(slots))
    returns = "Tensor" if outputs == 0 else "(" + ", ".join(["Tensor"] * outputs) + ")"

    def fill(tensors):
        it = iter(tensors)
        return [next(it) if t is TENSOR else t for t in template]

    def forward(*tensors):
        out = fn.apply(*fill(tensors))
        outs = (out,) if outputs == 0 else tuple(out)
        # an op's output may not alias its input: a Function returning its input (or a view) gets a copy
        fresh = tuple(o.clone() if any(_aliases(o, t) for t in tensors) else o for o in outs)
        return fresh[0] if outputs == 0 else fresh

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", forward, mutates_args=(), schema=f"({params}) -> {returns}",
                                 tags=(torch.Tag.pointwise,) if pointwise else ())
    op.register_fake(forward)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(saved, needs, strict=True)]
            out = fn.apply(*fill(leaves))
        outs = (out,) if outputs == 0 else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
        wanted = [t for t in leaves if t.requires_grad]
        if not pairs or not wanted:
            return tuple(None for _ in leaves)
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        return tuple(next(got) if t.requires_grad else None for t in leaves)

    op.register_autograd(backward, setup_context=setup_context)
    _DEFINED[name] = getattr(getattr(torch.ops, NAMESPACE), name).default
    return _DEFINED[name]


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # fake/meta tensors without storage: assume it may alias
        return a is b or a._base is b or b._base is a or (a._base is not None and a._base is b._base)
