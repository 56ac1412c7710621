"""Keep less for backward, with the same values: ops whose ATen form saves a tensor backward can compute again.

Each rewrite replaces a few ATen ops by one op of :mod:`fxshard.runtime.activations` that computes the same forward
values and gradients bit for bit, and keeps fewer tensors for backward:

- ``silu(gate) * up`` (SwiGLU MLPs: Llama, Qwen, Mistral) becomes ``rt.silu_mul(gate, up)``: the ATen ops keep
  gate, ``silu(gate)`` and up; ``silu_mul`` keeps gate and up and computes ``silu(gate)`` again in backward (one
  elementwise op), as Transformer Engine's SwiGLU does::

      silu_mul = rt.silu_mul(linear_4, linear_5)  # [4, 16, 64] bf16 S(2)

- RMSNorm's fp32 part, ``x32 = x.to(float32)``, ``x32 * rsqrt(mean(x32 ** 2, -1, keepdim) + eps)`` of an x in a
  lower precision (``--dtype bf16``), becomes ``rt.rms_normalize(x, eps)``: the ATen ops keep x32 (``pow`` and
  ``mul`` save it: 4 bytes an element) and rsqrt's result; ``rms_normalize`` keeps x (2 bytes an element) and runs
  the ops again in backward (Transformer Engine's RMSNorm keeps its input too)::

      mul = rt.rms_normalize(hidden_states, 1e-06)  # [4, 8, 64] f32 S(1)

A pattern qualifies only as the ATen ops stand: the intermediate value read by nothing else, operands of the same
shape and dtype (no broadcast).  Runs after the collectives (the ops are local: their placements are decided) and
before the pipeline cut, on every layout; ``fxshard plan`` traces the new op as it runs (:mod:`fxshard.cost.saved`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.ir.context import CompileContext, spec, update_spec
from fxshard.runtime import activations as rta

aten = torch.ops.aten


def saved_activations_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    for _name, match, rewrite in REWRITES:
        for node in list(gm.graph.nodes):
            found = match(node)
            if found is not None:
                rewrite(gm, node, *found)
    gm.recompile()
    return gm


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _silu_times(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(silu, other)`` when ``node`` is ``mul(silu(gate), other)`` (either order) that ``silu_mul`` computes."""
    if node.op != "call_function" or node.target is not aten.mul.Tensor or node.kwargs or len(node.args) != 2:
        return None
    for i, silu in enumerate(node.args):
        other = node.args[1 - i]
        if not (isinstance(silu, fx.Node) and silu.target is aten.silu.default and len(silu.users) == 1
                and len(silu.args) == 1 and not silu.kwargs and other is not silu):
            continue
        a, b, out = _val(silu), _val(other), _val(node)
        if a is None or b is None or out is None or a.is_complex():
            continue
        if a.shape == b.shape == out.shape and a.dtype == b.dtype == out.dtype and a.is_floating_point():
            return silu, other
    return None


def _silu_mul(gm: fx.GraphModule, node: fx.Node, silu: fx.Node, up: fx.Node) -> None:
    """``node`` (the mul) becomes ``rt.silu_mul(gate, up)`` in place: its name, value and placement kept."""
    gate = silu.args[0]
    needs = spec(node).inputs
    if needs is not None:  # the placement each input must have: silu's own input's for gate
        silu_needs = spec(silu).inputs
        by_arg = dict(zip(node.args, needs, strict=True))
        needs = ((silu_needs[0] if silu_needs else by_arg[silu]), by_arg[up])
    node.target, node.args, node.kwargs = rta.silu_mul, (gate, up), {}
    update_spec(node, inputs=needs)
    gm.graph.erase_node(silu)


def _rms_normalize_of(node: fx.Node) -> tuple[fx.Node, float] | None:
    """``(x, eps)`` when ``node`` is ``mul(x32, rsqrt(add(mean(pow(x32, 2), [-1], True), eps)))`` with ``x32`` x's
    upcast to float32 (x in a lower precision), every value between read by nothing else."""
    if node.op != "call_function" or node.target is not aten.mul.Tensor or node.kwargs or len(node.args) != 2:
        return None
    x32, rsqrt = node.args
    chain = _only(rsqrt, aten.rsqrt.default, 1)
    add = _only(chain and chain.args[0], aten.add.Tensor, 2)
    mean = _only(add and add.args[0], aten.mean.dim, 3)
    power = _only(mean and mean.args[0], aten.pow.Tensor_Scalar, 2)
    if not (power and mean.args[1:] in (([-1], True),) and power.args[1] == 2 and power.args[0] is x32
            and isinstance(add.args[1], float) and _upcast(x32) and set(x32.users) == {power, node}):
        return None
    return x32.args[0], add.args[1]


def _only(node, target, arity: int) -> fx.Node | None:
    """``node`` when it calls ``target`` with ``arity`` positional arguments and one user."""
    ok = (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target and not node.kwargs
          and len(node.args) == arity and len(node.users) == 1)
    return node if ok else None


def _upcast(node: fx.Node) -> bool:
    """Whether ``node`` is ``aten.to.dtype(x, float32)`` of an x in a lower floating precision."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.to.dtype
            and len(node.args) == 2 and not node.kwargs and node.args[1] is torch.float32):
        return False
    x = _val(node.args[0])
    return x is not None and x.dtype in (torch.bfloat16, torch.float16)


def _rms_normalize(gm: fx.GraphModule, node: fx.Node, x: fx.Node, eps: float) -> None:
    """``node`` (the mul) becomes ``rt.rms_normalize(x, eps)`` in place; the ops it stands for go."""
    rsqrt = node.args[1]
    add = rsqrt.args[0]
    mean = add.args[0]
    power = mean.args[0]
    x32 = node.args[0]
    needs = spec(x32).inputs
    node.target, node.args, node.kwargs = rta.rms_normalize, (x, eps), {}
    update_spec(node, inputs=needs)
    for n in (rsqrt, add, mean, power, x32):
        gm.graph.erase_node(n)


# (name, match: node -> the nodes the rewrite reads or None, rewrite(gm, node, *those)), applied in this order
REWRITES = (("silu_mul", _silu_times, _silu_mul), ("rms_normalize", _rms_normalize_of, _rms_normalize))
