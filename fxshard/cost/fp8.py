"""What an fp8 linear costs the plan: its products at the fp8 peak, its casts as memory traffic, its amaxes.

``--dtype fp8`` rewrites each eligible ``nn.Linear`` into ``rt.fp8_linear`` / ``rt.fp8_linear_tp``
(:mod:`fxshard.runtime.fp8`, torchao's recipe).  Per call, forward:

- the product, ``2·m·n·k`` FLOPs as ``flop_counter`` counts a linear, at the profile's ``peak_flops["fp8"]`` (the
  op class ``fp8`` of :mod:`fxshard.cost.timemodel`), reading one-byte operands and writing the output at the
  compute dtype;
- the casts around it, memory-bound: each operand's amax (one read of the high-precision tensor) and its scaled
  cast (one more read, a one-byte write): ``(2·s + 1)`` bytes per element at ``s`` bytes, two kernels each.
  Backward casts, as the runtime (and torchao) does: the output gradient twice (for the input gradient and for the
  weight gradient), and the input and weight again (torchao saves the high-precision ones).  The time model charges
  the two at the memory bandwidth, forward's in forward and backward's in backward (``Piece.casts``,
  ``Piece.casts_bwd``), not as the other ops' traffic: selective recompute does not run them again.
- under tp, the amaxes ``fp8_linear_tp`` all-reduces with MAX: a few float32 values
  (:func:`fxshard.runtime.fp8.amax_elements`), 4 bytes each.

Memory: torchao's recipe saves the high-precision input and weight for backward, as a bf16 linear does, so the
saved bytes do not change (the plan's trace runs the call itself: :mod:`fxshard.cost.saved`); the one-byte copies
live only during the call: a candidate of the transient::

    flops, mm_bytes, cast_bytes, backward_cast_bytes, copies = fp8_costs(node, dims)
"""

from __future__ import annotations

import math

import sympy
import torch.fx as fx

from fxshard.runtime import fp8 as rt_fp8

FP8_TARGETS = (rt_fp8.fp8_linear, rt_fp8.fp8_linear_tp)
CAST_KERNELS = 4  # amax and cast, of the input and of the weight


def _weight(node: fx.Node) -> fx.Node:
    return node.kwargs["weight"] if "weight" in node.kwargs else node.args[1]


def fp8_costs(node: fx.Node, dims) -> tuple[sympy.Expr, ...]:
    """(forward FLOPs, bytes the product reads and writes, bytes forward's casts read and write, bytes backward's
    casts read and write, bytes of the one-byte copies) of an fp8 linear ``node``, on ``dims`` (node -> its local
    symbolic shape)."""
    return fp8_product_costs(node.args[0], _weight(node), node, dims)


def fp8_product_costs(x: fx.Node, w: fx.Node, out: fx.Node, dims, input_cast: bool = True) -> tuple[sympy.Expr, ...]:
    """:func:`fp8_costs` of the product of ``x`` and ``w`` into ``out``; ``input_cast`` False: ``x``'s casts are
    another product's (``rt.fp8_linears_regathered`` casts the input its linears share once each way)."""
    size = x.meta["val"].element_size()
    x_n, w_n = _numel(dims(x)), _numel(dims(w))
    inputs = x_n + w_n if input_cast else w_n
    out_n = _numel(dims(out))
    flops = 2 * out_n * dims(x)[-1]
    mm = x_n + w_n + out_n * out.meta["val"].element_size()
    casts, casts_bwd = (2 * size + 1) * inputs, (2 * size + 1) * (inputs + 2 * out_n)
    return flops, mm, casts, casts_bwd, x_n + w_n


def amax_bytes(node: fx.Node, dims, direction: str) -> sympy.Expr:
    """Bytes of the amaxes ``fp8_linear_tp`` (or ``fp8_linears_regathered``) all-reduces in ``direction`` (float32
    values)."""
    x = node.args[0]
    recipe = node.kwargs.get("recipe", "tensorwise")
    if "weights" in node.kwargs:
        shapes = [dims(w) for w in node.kwargs["weights"]]
        rows = _numel(dims(x)) / shapes[0][1]
        return 4 * sympy.sympify(rt_fp8.fp8_amax_elements(recipe, rows, shapes, direction))
    out_features, in_features = dims(_weight(node))
    rows = _numel(dims(x)) / in_features
    return 4 * sympy.sympify(rt_fp8.amax_elements(recipe, rows, in_features, out_features, direction,
                                                  node.kwargs.get("split", "in")))


def _numel(shape) -> sympy.Expr:
    return sympy.expand(math.prod(shape, start=sympy.Integer(1)))
