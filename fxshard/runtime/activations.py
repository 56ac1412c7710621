"""Ops that keep less for backward than the ATen ops they replace, with the same values forward and backward.

``passes/saved_activations.py`` writes them where the captured graph has the ops they stand for:

==============  ==============================  ========================================================
function        stands for                      keeps for backward
==============  ==============================  ========================================================
silu_mul        ``silu(gate) * up`` (SwiGLU)    gate and up; silu(gate) computed again in backward (the
                                                ATen ops keep it too: one more tensor of the gate's size)
==============  ==============================  ========================================================

Backward runs the ATen ops' own derivative formulas on the same values, so gradients are bit-identical to the ops'
own: ``silu_mul`` computes ``silu(gate)`` again (the same tensor bit for bit) and applies mul's and silu's
derivatives as autograd does.  Under
torch.compile they are the ATen ops, for the compiler to choose what it saves::

    act = rt.silu_mul(gate, up)       # = aten.mul(aten.silu(gate), up)
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return aten.mul.Tensor(aten.silu.default(gate), up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        silu = aten.silu.default(gate)  # again: the tensor the forward multiplied
        # mul's derivative (grad * other for each side), then silu's (silu_backward), as autograd runs them
        grad_gate = aten.silu_backward.default(aten.mul.Tensor(grad, up), gate) if ctx.needs_input_grad[0] else None
        grad_up = aten.mul.Tensor(grad, silu) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, keeping gate and up for backward (not ``silu(gate)``: it is computed again there)."""
    if torch.compiler.is_compiling():
        return aten.mul.Tensor(aten.silu.default(gate), up)
    return _SiluMul.apply(gate, up)

