"""Keep the backward of every custom ``torch.autograd.Function`` a model applies.

Non-strict torch.export runs ``Fn.forward`` and keeps its operations only; autograd would then take their
gradient instead of the Function's ``backward`` (Bloom's tanh-GeLU, Phimoe's router multiplier, any
straight-through estimator), and training would differ from one device.  While capturing, every
``Fn.apply(...)`` becomes one call of a custom op (``fxshard/runtime/functions.py``) whose backward is the
Function's own; the rank files define the same op on load.  Each wrapped call is a :class:`FunctionOp`::

    program.functions["GeLUFunction_5d0c2a81"]
    # FunctionOp(module='transformers.models.bloom.modeling_bloom', qualname='GeLUFunction',
    #            template=(rt.TENSOR,), outputs=0, pointwise=True, fqns=('transformer.h.0.mlp.gelu_impl', ...))

A call that cannot be carried exactly is refused, naming the module and the Function: a Function the rank
files could not import (defined in the model file or inside a function), non-tensor outputs, in-place
changes of its inputs (``mark_dirty``), keyword arguments, arguments that are neither tensors nor plain
constants, or a forward that draws random numbers (the backward recomputes it).

A Function whose forward and backward trace to elementwise ATen ops only, with every tensor the same shape,
is tagged pointwise: it then splits over tp as any elementwise op does (Bloom's MLP stays column -> row split).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

from fxshard.capture.custom_ops import MODEL_FILE_MODULE
from fxshard.errors import CaptureError
from fxshard.runtime import functions as rt_functions
from fxshard.runtime.functions import TENSOR

_LITERALS = (type(None), bool, int, float, str, torch.dtype)
# besides elementwise ops, what a pointwise Function's trace may hold: the copies autograd makes
_NEUTRAL = {torch.ops.aten.detach.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default}


@dataclass(frozen=True)
class FunctionOp:
    """One custom autograd.Function called one way, as the op the rank files define."""

    module: str
    qualname: str
    template: tuple  # the Function's arguments, TENSOR where a tensor goes
    outputs: int  # 0: returns one tensor; k: a tuple of k tensors
    pointwise: bool
    fqns: tuple[str, ...]  # modules applying it

    def define_line(self, name: str) -> str:
        """The rank file's line defining the op."""
        template = _literal(self.template)
        pointwise = ", pointwise=True" if self.pointwise else ""
        return (f"rt.autograd_function({name!r}, {self.module!r}, {self.qualname!r}, {template}, "
                f"outputs={self.outputs}{pointwise})")


@contextlib.contextmanager
def wrapped_functions(model: torch.nn.Module):
    """While export traces ``model``, replace each custom ``Fn.apply`` by its op; yield ``(ops, refusals)``:
    op name -> :class:`FunctionOp`, and the :class:`CaptureError` of each call that cannot be wrapped (that
    call runs as before: capture raises the first refusal once export returns)."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    stack: list[str] = []
    ops: dict[str, FunctionOp] = {}
    refusals: list[CaptureError] = []
    inside = [0]  # Functions applied by a wrapped Function's forward belong to it
    original = torch.autograd.Function.__dict__["apply"]  # a classmethod (torch 2.13) or a C one (2.14)

    def call(cls, *args, **kwargs):
        return original.__get__(None, cls)(*args, **kwargs)

    def apply(cls, *args, **kwargs):
        if cls.__module__.startswith("torch.") or inside[0]:  # torch's own (checkpointing) keep their gradient
            return call(cls, *args, **kwargs)
        fqn = stack[-1] if stack else ""
        inside[0] += 1
        try:
            name, fop = _wrap(cls, args, kwargs, fqn, lambda: call(cls, *args, **kwargs))
        except CaptureError as e:
            refusals.append(e)
            return call(cls, *args, **kwargs)
        finally:
            inside[0] -= 1
        old = ops.get(name)
        ops[name] = fop if old is None else FunctionOp(**{**old.__dict__, "fqns": tuple(sorted({*old.fqns, fqn}))})
        op = rt_functions.autograd_function(name, fop.module, fop.qualname, fop.template, fop.outputs, fop.pointwise)
        inside[0] += 1
        try:
            return op(*[a for a in args if isinstance(a, torch.Tensor)])
        finally:
            inside[0] -= 1

    def push(mod, _args):
        stack.append(names.get(id(mod), stack[-1] if stack else ""))

    def pop(mod, _args, _out):
        stack.pop()

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(push),
               torch.nn.modules.module.register_module_forward_hook(pop, always_call=True)]
    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield ops, refusals
    finally:
        torch.autograd.Function.apply = original
        for h in handles:
            h.remove()


def _wrap(cls: type, args: tuple, kwargs: dict, fqn: str, run) -> tuple[str, FunctionOp]:
    """The op name and :class:`FunctionOp` of one ``cls.apply(*args, **kwargs)``, or a CaptureError."""
    where = f"{fqn or 'model'}: applies the custom torch.autograd.Function {cls.__qualname__} (from {_origin(cls)})"
    fix = ("write the computation without a custom autograd.Function (plain torch ops whose autograd is the "
           "gradient you want), or register it as a torch.library.custom_op with register_autograd in an "
           "importable module")

    def refuse(found: str, how: str = fix) -> CaptureError:
        return CaptureError(f"{where}; fxshard keeps a Function's backward by running it as a custom op, which "
                            f"needs {found}; {how}")

    module = cls.__module__
    if module.startswith(MODEL_FILE_MODULE) or module == "__main__":
        raise refuse("a Function the rank files can import, and this one is defined in the model file (rank "
                     "files run without it)", "move the Function into a module the model file imports")
    if "<locals>" in cls.__qualname__ or _resolves(module, cls.__qualname__) is not cls:
        raise refuse(f"a Function importable as {module}.{cls.__qualname__}, and it is not (defined inside a "
                     "function?)", "define the Function at the top level of a module")
    if kwargs:
        raise refuse(f"positional arguments, and it is given keyword argument(s) {', '.join(sorted(kwargs))}",
                     "pass them positionally")
    template = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            template.append(TENSOR)
        elif _is_literal(a):
            template.append(a)
        else:
            raise refuse(f"tensors and plain constants (None, bool, int, float, str, dtype) as arguments, and "
                         f"argument {i} is a {type(a).__name__}")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    versions = [t._version for t in tensors]
    with disable_proxy_modes_tracing(), torch.no_grad():
        out = run()  # on the capture's fake tensors, recording nothing: what the forward returns
    if [t._version for t in tensors] != versions:
        raise refuse("a forward that leaves its inputs unchanged, and this one changes an input in place "
                     "(mark_dirty)", "return a new tensor instead of changing the input")
    if isinstance(out, torch.Tensor):
        outs, outputs = [out], 0
    elif isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        outs, outputs = list(out), len(out)
    else:
        kinds = ["Tensor" if isinstance(o, torch.Tensor) else type(o).__name__
                 for o in (out if isinstance(out, (tuple, list)) else [out])]
        raise refuse(f"tensor outputs, and its forward returns {type(out).__name__} of {', '.join(kinds) or 'nothing'}",
                     "return tensors only (pass other values around the Function)")
    graph = _trace(cls, tuple(template), tensors, outs)
    drawing = [n for n in graph.nodes if n.op == "call_function"
               and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    if drawing:
        raise refuse(f"a forward that draws no random numbers (its backward recomputes the forward), and this "
                     f"one calls {drawing[0].target}", "draw the random values outside the Function and pass them in")
    pointwise = _pointwise(graph, tensors, outs)
    name = rt_functions.op_name(module, cls.__qualname__, template, outputs) + ("_pw" if pointwise else "")
    return name, FunctionOp(module, cls.__qualname__, tuple(template), outputs, pointwise, (fqn,))


def _trace(cls: type, template: tuple, tensors: list[torch.Tensor], outs: list[torch.Tensor]) -> torch.fx.Graph:
    """Forward and backward of ``cls`` as one ATen graph, traced on meta tensors of the call's shapes."""
    def fill(ts):
        it = iter(ts)
        return [next(it) if t is TENSOR else t for t in template]

    def joint(*ts):
        inputs, grads = ts[:len(tensors)], ts[len(tensors):]
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        out = cls.apply(*fill(leaves))
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        wanted = [t for t in leaves if t.requires_grad]
        if not pairs or not wanted:
            return outs
        return outs, torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)

    def meta(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    with disable_proxy_modes_tracing(), torch._subclasses.fake_tensor.unset_fake_temporarily():
        return make_fx(joint, tracing_mode="fake")(*map(meta, tensors), *map(meta, outs)).graph


def _pointwise(graph: torch.fx.Graph, tensors: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
    """Whether every output element (and every input gradient element) depends only on the same element of
    the inputs: one output, every tensor the same shape, and only elementwise ops in forward and backward."""
    if len(outs) != 1 or not tensors or any(t.shape != outs[0].shape for t in tensors):
        return False
    for n in graph.nodes:
        if n.op == "get_attr":
            return False  # a constant tensor could vary along a dimension
        if n.op == "call_function" and n.target not in _NEUTRAL \
                and torch.Tag.pointwise not in getattr(n.target, "tags", ()):
            return False
    return True


def _is_literal(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_is_literal(x) for x in v)
    return isinstance(v, _LITERALS) and not isinstance(v, torch.SymInt)


def _literal(v) -> str:
    """Python source for a template entry (floats exact, inf and nan included)."""
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"
    if isinstance(v, (tuple, list)):
        inner = ", ".join(map(_literal, v)) + ("," if len(v) == 1 and isinstance(v, tuple) else "")
        return f"({inner})" if isinstance(v, tuple) else f"[{inner}]"
    return repr(v)


def _resolves(module: str, qualname: str):
    try:
        return rt_functions.resolve(module, qualname)
    except (ImportError, AttributeError):
        return None


def _origin(cls: type) -> str:
    origin = cls.__module__
    if origin.startswith(MODEL_FILE_MODULE):  # modelfile's import name of the model file
        origin = Path(inspect.getsourcefile(cls) or "model file").name
    return origin
