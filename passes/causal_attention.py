"""Attention whose mask is the causal triangle calls ``scaled_dot_product_attention`` with ``is_causal=True``.

Under capture, transformers cannot take its ``is_causal`` shortcut: it builds the causal mask as a ``[B, 1, S, S]``
tensor from positions and passes it to SDPA, which keeps a float copy of it for backward in every layer
(4·B·S² bytes a layer in fp32: at 128k tokens, more than a device holds).  The mask's values depend on no input,
so they are a constant of the program: this pass computes them (the subgraph that makes the mask, on CPU, with the
captured sizes) and, only where every element equals the causal triangle (a query attends to the keys at its
position and before), drops the mask and sets ``is_causal``.  A mask that reads an input (a padding mask, the
documents of a packed batch, position ids given by the caller) or any other pattern (a sliding window) is kept,
as written.  The rank files then make no S x S tensor, and context parallelism sees a causal attention that it
computes block by block (``rt.cp_causal_attention``)::

    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(..., is_causal=True, ...)

A mask of more than ``LIMIT`` elements is not computed (the proof would allocate it) and is kept; a note says so.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.graph import ancestors
from fxshard.ir.context import CompileContext
from fxshard.ir.sharding import argument, set_argument, shape

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
LIMIT = 1 << 28  # elements of the largest value computed to prove a mask causal (256 MiB of booleans)


def causal_attention_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    proven: dict[fx.Node, bool] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or argument(node, "is_causal"):
            continue
        mask = argument(node, "attn_mask")
        if not isinstance(mask, fx.Node) or argument(node, "dropout_p"):
            continue
        rows, keys = shape(node.args[0])[-2], shape(node.args[1])[-2]
        if mask not in proven:
            proven[mask] = rows == keys and _is_causal(mask, rows, ctx)
        if proven[mask]:
            set_argument(node, "attn_mask", None)
            set_argument(node, "is_causal", True)
    for mask, causal in proven.items():
        if causal:
            _erase_unused(gm, mask)
    if any(proven.values()):
        ctx.notes.append(f"causal attention: {sum(proven.values())} causal mask(s) built from positions alone "
                         "proven to be the causal triangle; scaled_dot_product_attention called with is_causal=True, "
                         "no S x S mask made")
    gm.recompile()
    return gm


def has_masked_attention(gm: fx.GraphModule) -> bool:
    """Whether an attention reads a mask (the registry's gate: the pass is named in the rank files' headers only where
    it can act)."""
    return any(n.target is SDPA and isinstance(argument(n, "attn_mask"), fx.Node) for n in gm.graph.nodes)


def _is_causal(mask: fx.Node, size: int, ctx: CompileContext) -> bool:
    """Whether ``mask`` reads no input and every one of its ``[.., size, size]`` elements is the causal triangle's
    (boolean: True on and below the diagonal; additive: 0 there, -inf above)."""
    nodes = _ancestors(mask)
    if nodes is None:
        return False
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or tuple(val.shape[-2:]) != (size, size):
        return False
    largest = max(_numel(n) for n in nodes)
    if largest > LIMIT:
        ctx.notes.append(f"causal attention: {mask.name} ({largest} elements) not computed to prove it causal; the "
                         "mask is kept as the model builds it")
        return False
    values = _evaluate(nodes)
    if values is None:
        return False
    m = values[mask]
    tril = torch.ones(size, size, dtype=torch.bool).tril()
    if m.dtype == torch.bool:
        return bool((m == tril).all())
    if not m.is_floating_point():
        return False
    return bool(((m == 0) == tril).all()) and bool(torch.isneginf(m[..., ~tril]).all())


def _ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order, or None if it reads a placeholder (an input, a
    parameter or a buffer) or anything but ATen calls."""
    found = set()
    for n in ancestors([mask]):
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return None
        found.add(n)
    return [n for n in mask.graph.nodes if n in found]


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _evaluate(nodes: list[fx.Node]) -> dict | None:
    """The values of ``nodes`` (constants of the program), computed on CPU; None if an op has no CPU value."""
    env: dict = {}

    def value(a):
        if isinstance(a, fx.Node):
            return env[a]
        return torch.device("cpu") if isinstance(a, torch.device) else a

    for n in nodes:
        args = torch.utils._pytree.tree_map(value, fx.node.map_arg(n.args, value))
        kwargs = torch.utils._pytree.tree_map(value, fx.node.map_arg(n.kwargs, value))
        try:
            env[n] = n.target(*args, **kwargs)
        except (RuntimeError, TypeError, NotImplementedError):
            return None
    return env


def _erase_unused(gm: fx.GraphModule, mask: fx.Node) -> None:
    """Erase ``mask`` and what only it read, now that no attention reads it (a node's inputs are read before it is
    erased, which empties them: not :func:`fxshard.graph.walk`)."""
    todo, erased = [mask], set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        erased.add(n)
        todo.extend(inputs)
