"""How a rank file writes one value, argument and line: names, shapes and dtypes, placements, the model's line.

Code generation (:mod:`fxshard.codegen.emit`) and the manifest's collective list
(:mod:`fxshard.codegen.collective_list`) name values here alike, so a collective the manifest records is the
line of that name in the file::

    attr_name("model.layers.0.mlp.up_proj.weight", set())   # 'model_layers_0_mlp_up_proj_weight'
    line_note(node, tp=2)                                    # '[2, 16, 32] f32 S(2)'
"""

from __future__ import annotations

import math
import operator
import re

import torch
import torch.fx as fx

from fxshard.graph import NOT_MODEL as _NOT_MODEL
from fxshard.graph import model_line
from fxshard.ir.blocks import BlockUnit
from fxshard.ir.comm import FUSED_LINEARS, FUSED_NAMES, kind_of
from fxshard.ir.context import CompileContext, Group, RankValue, spec
from fxshard.ir.layout import CP, DP, PP, TP
from fxshard.ir.placement import Partial, Replicate, Shard, local_shape
from fxshard.runtime import collectives as rt_collectives
from fxshard.runtime import draws as rt_draws
from fxshard.runtime import random as rt_random

# frames of these packages are not the model's: a group header names the innermost frame outside them


# dtypes as the per-line comments write them
SHORT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "bool", torch.complex64: "c64"}


# names a class gives none of its values: its own attributes and process groups
RESERVED = {"device", TP, PP, DP, "forward", "training", "return_outputs", "INPUTS", "OUTPUTS", "BATCH"}


def attr_name(fqn: str, taken: set[str]) -> str:
    base = "".join(c if c.isalnum() else "_" for c in fqn) or "tensor"
    if base[0].isdigit():
        base = "t_" + base
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def block_names(unit: BlockUnit, ctx: CompileContext) -> tuple[dict[str, fx.Node], dict[fx.Node, str]]:
    """The names in the class of a block's submodule: its attributes (attribute -> its parameter or buffer
    placeholder, named by the FQN inside the block) and its values (node -> :func:`local_name`), so that
    identical blocks have identical code and share the class::

        attrs, names = block_names(unit, ctx)   # {'attn_q_proj_weight': p_..., ...}, {linear: 'linear', ...}
    """
    state = ctx.program.state_by_name()
    taken = set(RESERVED)
    attrs = {attr_name(state[n.name].fqn.removeprefix(unit.fqn + "."), taken): n for n in unit.state}
    return attrs, {n: local_name(n, taken) for n in unit.nodes}


def local_name(node: fx.Node, taken: set[str]) -> str:
    """The name of ``node`` in a block's class: its op, numbered (``linear``, ``linear_1``, ...); a fused
    ``copy_to_linears`` is numbered among the ``copy_to`` (passes/overlap.py), so its class reads as without
    the fusion but for the fused lines."""
    name = attr_name(base_name(node), taken)
    return name.replace("copy_to", "copy_to_linears", 1) if node.target is rt_collectives.copy_to_linears else name


def base_name(node: fx.Node) -> str:
    """The name torch.fx gives a node before numbering it: its op (``linear``, ``all_reduce``, ``getitem``); the
    fused ``copy_to_linears`` and its outputs the ``copy_to`` and ``linear`` they replace (passes/overlap.py)."""
    target = node.target
    if target is rt_collectives.copy_to_linears:
        return "copy_to"
    if target is operator.getitem and getattr(node.args[0], "target", None) in FUSED_LINEARS:
        return "linear"
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__.split(".")[-1]
    source = kind_of(node.args[0].target) if target is operator.getitem and isinstance(node.args[0], fx.Node) else None
    if source is not None and source.outputs:  # a ring step's attn_out, attn_lse, next_key, next_value
        return source.outputs[node.args[1]]
    return getattr(target, "__name__", "value").strip("_") or "value"


def value_name(node: fx.Node) -> str:
    """What a value is, as a name: the variable the model's code assigns it to, ``<module>_out`` for a value a
    module returns (``blocks_out`` for ``blocks.3``'s), else its op."""
    var = assigned_name(node)
    if var == "out" and spec(node).fqn:
        parts = [p for p in spec(node).fqn.split(".") if not p.isdigit()]
        return f"{parts[-1]}_out" if parts else "out"
    return var if var and var != "out" else base_name(node)


def assigned_name(node: fx.Node) -> str:
    """The variable the innermost line of the model's code that made ``node`` assigns (``hidden_states`` of
    ``hidden_states = residual + hidden_states``), ``out`` for a line that returns it, or ""."""
    trace = node.meta.get("stack_trace") or ""
    for path, code in reversed(re.findall(r'File "([^"]+)", line \d+, in \S+\n\s*(.*)', trace)):
        if not any(part in path for part in _NOT_MODEL):
            m = re.match(r"([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)", code)
            return m[1] if m else "out" if code.startswith("return ") else ""
    return ""


def replica_elements(node: fx.Node, tp: int) -> int:
    """The elements ``rt.sum_replicas`` all-reduces (on every rank alike): each replicated part in its slots."""
    total = 0
    for w, (dim, pieces) in zip(node.args[0], node.kwargs["layouts"].values[0], strict=True):
        local = local_shape(tuple(w.meta["val"].shape), spec(w).placement, tp)
        row = math.prod(local) // local[dim]
        total += sum(length * slots * row for _start, length, _slot, slots in pieces)
    return total


def short_dtype(dtype: torch.dtype) -> str:
    return SHORT_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def value_text(node: fx.Node, tp: int) -> str:
    """``[2, 16, 32] f32``: the local shape and dtype of a tensor value on this rank; "" for other values."""
    val = node.meta.get("val")
    placement = spec(node).placement
    if not isinstance(val, torch.Tensor) or isinstance(placement, tuple):
        return ""
    return f"{list(local_shape(tuple(val.shape), placement, tp))} {short_dtype(val.dtype)}"


def line_note(node: fx.Node, tp: int) -> str:
    """The comment of one line: the value's local shape and dtype, then its placement (a collective's
    placement before and after; what each collective does is said once, in the file's header)."""
    s = spec(node)
    value = value_text(node, tp)
    p = s.placement
    if s.collective in FUSED_NAMES:  # its input's value; the linears' after the arrow
        return f"{value_text(node.args[0], tp)} {spec(node.args[0]).placement} -> ({', '.join(map(str, p))})"
    if s.collective == "sum_replicas":  # a layer's weights: their splits, each part summed over its ranks in backward
        return f"({', '.join(map(str, p))})"
    if (s.collective and s.collective != "fp8_linear_tp"  # an fp8 linear under --cp: its tp placements
            and any(isinstance(a, Group) and a.axis == CP for a in node.args)):  # over cp: its placements there
        return f"{value} cp {_short(spec(node.args[0]).seq)} -> {_short(s.seq)}".strip()
    if s.collective:
        src = spec(node.args[0]).placement
        return f"{value} {src} -> {p}".strip()
    if isinstance(p, tuple):
        place = " ".join(str(x) for x in p) if any(not isinstance(x, Replicate) for x in p) else ""
    else:
        place = str(p) if isinstance(p, (Shard, Partial)) else ""
    if node.target is rt_random.dropout:  # see passes/dropout.py
        place = (place + "  " if place else "") + "layout-invariant mask, as on one device"
    if node.target is rt_draws.draw:
        place = (place + "  " if place else "") + "drawn as on one device"
    return f"{value} {place}".strip()


def _short(p) -> str:
    """``S(2)``, ``R``; a tuple of them ``(S(2), S(2))``."""
    return f"({', '.join(map(str, p))})" if isinstance(p, tuple) else str(p if p is not None else Replicate())


# Python's operators on sizes (torch.export's checks of a size that depends on the data, u0 >= 0), as operators
_INFIX = {operator.ge: ">=", operator.le: "<=", operator.gt: ">", operator.lt: "<", operator.eq: "==",
          operator.ne: "!=", operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//",
          operator.mod: "%"}


def call_text(node: fx.Node, names, coords) -> str:
    """The call one line makes: ``aten.linear.default(x, self.w)``, ``rt.all_reduce(linear, self.tp)``, ``x[0]``;
    ``names``: node -> its name in the class."""
    if node.target is operator.getitem:
        return f"{names[node.args[0]]}[{node.args[1]}]"
    target = node.target
    if target in _INFIX and len(node.args) == 2 and not node.kwargs:  # export's checks of a data-dependent size
        left, right = (arg_text(a, names, coords) for a in node.args)
        return f"{left} {_INFIX[target]} {right}"
    if isinstance(target, torch._ops.OpOverload):
        fn = op_text(target)
    elif target.__module__.startswith("fxshard.runtime"):
        fn = f"rt.{target.__name__}"
    else:
        fn = f"{target.__module__}.{target.__qualname__}"
    args = [arg_text(a, names, coords) for a in node.args]
    args += [f"{k}={arg_text(v, names, coords)}" for k, v in node.kwargs.items()]
    return f"{fn}({', '.join(args)})"


def op_text(target: torch._ops.OpOverload) -> str:
    """``aten.linear.default``; an op of another namespace by its full path."""
    ns = target.namespace
    packet = target.overloadpacket.__name__.split(".")[-1]
    if ns == "aten":
        return f"aten.{packet}.{target._overloadname}"
    return f"torch.ops.{ns}.{packet}.{target._overloadname}"


def arg_text(a, names, coords) -> str:
    """One argument as Python: a value by its name, a process group as ``self.<axis>``, a per-rank value at
    ``coords``, a constant as its literal."""
    if isinstance(a, fx.Node):
        return names[a]
    if isinstance(a, Group):
        return f"self.{a.axis}"
    if isinstance(a, RankValue):
        return repr(a.at(coords))
    if isinstance(a, (list, tuple)):
        inner = ", ".join(arg_text(x, names, coords) for x in a)
        if isinstance(a, tuple):
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return f"torch.{str(a).removeprefix('torch.')}"
    if isinstance(a, torch.device):
        return "self.device"
    if isinstance(a, torch.layout):
        return f"torch.{str(a).removeprefix('torch.')}"
    if isinstance(a, torch.memory_format):
        return f"torch.{str(a).removeprefix('torch.')}"
    if isinstance(a, float):
        if math.isinf(a):
            return "float('inf')" if a > 0 else "float('-inf')"
        if math.isnan(a):
            return "float('nan')"
        return repr(a)
    if isinstance(a, (int, bool, str)) or a is None:
        return repr(a)
    if isinstance(a, torch._ops.OpOverload):  # the op rt.draw draws as one device (passes/dropout.py)
        return op_text(a)
    raise TypeError(f"fxshard codegen: cannot render argument {a!r} of type {type(a).__name__}")


def state_line(attr: str, s, node: fx.Node, tp: int, relative_to: str = "", ep: int = 1) -> str:
    val = node.meta["val"]
    placement = spec(node).placement
    shp = local_shape(tuple(val.shape), placement, tp)
    dtype = f"torch.{str(val.dtype).removeprefix('torch.')}"
    empty = f"torch.empty({shp}, dtype={dtype}, device=self.device)"
    fqn = s.fqn.removeprefix(relative_to + ".") if relative_to else s.fqn
    where = f"# {fqn}  {placement}" + ("" if placement == Replicate() else " on tp") + f"  global {list(val.shape)}"
    if ep > 1:  # the experts of this ep rank: val holds the local shape
        where = f"# {fqn}  S(0) on ep  global {[val.shape[0] * ep, *val.shape[1:]]}"
    if s.kind == "parameter":
        frozen = "" if s.trainable else ", requires_grad=False"  # no gradient, no optimizer state, no update
        return f"self.{attr} = torch.nn.Parameter({empty}{frozen})  {where}" + ("" if s.trainable else "  frozen")
    persistent = "" if s.persistent else ", persistent=False"
    return f'self.register_buffer("{attr}", {empty}{persistent})  {where}'


def group_comment(node: fx.Node, ctx: CompileContext, where: str = "", fqn: str | None = None,
                   block: bool = False, relative_to: str = "") -> str:
    """``# model.layers.2.self_attn.q_proj  Linear  column-parallel  (modeling_llama.py:244)``: the module a
    group of lines comes from (inside a block's class, its path in the block), its type, role and model line."""
    s = spec(node)
    fqn = s.fqn if fqn is None else fqn
    type_name = ctx.program.module_types.get(fqn, "")
    if block:
        return f"# {fqn}  {type_name}  (block submodule)"
    if relative_to and fqn == relative_to:
        label = "(the block)"
    else:
        label = fqn.removeprefix(relative_to + ".") if relative_to else fqn or "(model)"
    parts = [label, type_name] + ([s.role] if s.role else []) + ([f"({where})"] if where else [])
    return "# " + "  ".join(p for p in parts if p)


def group_lines(nodes, recomputed, guarded) -> dict[fx.Node, str]:
    """The model file:line of each group of lines, keyed by the group's first node: the first line of the
    model's code that one of the group's nodes comes from (a group: consecutive nodes of one module and role)."""
    where: dict[fx.Node, str] = {}
    first, key = None, None
    for node in nodes:
        k = (spec(node).fqn, spec(node).role, node in recomputed, node in guarded)
        if k != key:
            first, key = node, k
        if first not in where:
            line = model_line(node)
            if line:
                where[first] = line
    return where


def ep_of(fqn: str, ctx: CompileContext) -> int:
    """ep for the experts passes/expert_parallel.py split (their node values are this rank's part), else 1."""
    return ctx.layout.ep if fqn in ctx.expert_params else 1
