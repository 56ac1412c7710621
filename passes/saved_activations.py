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

- attention over grouped-query heads: transformers' ``repeat_kv`` (``unsqueeze``, ``expand``, ``reshape``: a copy
  of k and of v at the query heads) into ``scaled_dot_product_attention`` becomes the attention of the kv heads
  themselves with ``enable_gqa=True``, which keeps k and v at the kv heads (SDPA saves its inputs).  It is what the
  one-device program runs: transformers calls SDPA with ``enable_gqa`` when no mask is passed (the capture had one,
  which the causal-attention pass made ``is_causal``).  Forward values and the query's gradient are the same bit for
  bit as with the repeated k and v; k's and v's gradients are summed over the query heads of a group inside the
  kernel (in fp32) rather than by ``expand``'s backward over per-head gradients, so they round as on one device,
  not as the repeated program did (tests/test_saved_activations.py)::

      scaled_dot_product_attention = aten.scaled_dot_product_attention.default(add_1, add_2, transpose_2, None,
          scale=0.35, is_causal=True, enable_gqa=True)

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


def _grouped_kv(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(k, v)`` at the kv heads when ``node`` is an unmasked SDPA of k and v repeated to the query heads."""
    if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
        return None
    if len(node.args) != 4 or node.args[3] is not None or set(node.kwargs) - {"scale", "is_causal", "dropout_p"}:
        return None
    if node.kwargs.get("dropout_p", 0.0) != 0.0:
        return None
    k, v = _unrepeated(node.args[1], node), _unrepeated(node.args[2], node)
    if k is None or v is None or k[1] != v[1] or node.args[1] is node.args[2]:
        return None
    return k[0], v[0]


def _unrepeated(node, sdpa: fx.Node) -> tuple[fx.Node, int] | None:
    """``(x, repeats)`` when ``node`` is ``reshape(expand(unsqueeze(x, 2), [b, h, n, s, d]), [b, h * n, s, d])``
    read by ``sdpa`` alone (``repeat_kv``)."""
    reshape = node if isinstance(node, fx.Node) and set(node.users) == {sdpa} else None
    if reshape is None or reshape.target is not aten.reshape.default or reshape.kwargs or len(reshape.args) != 2:
        return None
    expand = _only(reshape.args[0], aten.expand.default, 2)
    unsqueeze = _only(expand and expand.args[0], aten.unsqueeze.default, 2)
    if unsqueeze is None or unsqueeze.args[1] != 2:
        return None
    sizes, shape = list(expand.args[1]), list(reshape.args[1])
    if len(sizes) != 5 or not all(isinstance(s, int) for s in sizes + shape):
        return None
    if shape != [sizes[0], sizes[1] * sizes[2], sizes[3], sizes[4]]:
        return None
    return unsqueeze.args[0], sizes[2]


def _gqa(gm: fx.GraphModule, node: fx.Node, k: fx.Node, v: fx.Node) -> None:
    """``node`` (the SDPA) reads k and v at the kv heads, with ``enable_gqa=True``; the repeats go."""
    repeats = [node.args[1], node.args[2]]
    needs = spec(node).inputs
    if needs is not None:  # q's, then each kv value's own (what its unsqueeze required)
        needs = (needs[0], *(spec(r.args[0].args[0]).inputs[0] if spec(r.args[0].args[0]).inputs else needs[i + 1]
                             for i, r in enumerate(repeats)), *needs[3:])
    node.args = (node.args[0], k, v, None)
    node.kwargs = {**node.kwargs, "enable_gqa": True}
    update_spec(node, inputs=needs)
    for r in repeats:
        expand = r.args[0]
        unsqueeze = expand.args[0]
        for n in (r, expand, unsqueeze):
            gm.graph.erase_node(n)


# (name, match: node -> the nodes the rewrite reads or None, rewrite(gm, node, *those)), applied in this order
REWRITES = (("silu_mul", _silu_times, _silu_mul), ("rms_normalize", _rms_normalize_of, _rms_normalize),
            ("gqa", _grouped_kv, _gqa))
