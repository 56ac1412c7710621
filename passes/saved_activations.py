"""Keep less for backward, with the same values: ops whose ATen form saves a tensor backward can compute again.

Each rewrite replaces a few ATen ops by one op of :mod:`fxshard.runtime.activations` that computes the same forward
values and gradients bit for bit, and keeps fewer tensors for backward:

- ``silu(gate) * up`` (SwiGLU MLPs: Llama, Qwen, Mistral) becomes ``rt.silu_mul(gate, up)``: the ATen ops keep
  gate, ``silu(gate)`` and up; ``silu_mul`` keeps gate and up and computes ``silu(gate)`` again in backward (one
  elementwise op), as Transformer Engine's SwiGLU does::

      silu_mul = rt.silu_mul(linear_4, linear_5)  # [4, 16, 64] bf16 S(2)

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


# (name, match: node -> the nodes the rewrite reads or None, rewrite(gm, node, *those)), applied in this order
REWRITES = (("silu_mul", _silu_times, _silu_mul),)
