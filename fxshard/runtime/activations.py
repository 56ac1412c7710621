"""Ops that keep less for backward than the ATen ops they replace, with the same values forward and backward.

``passes/saved_activations.py`` writes them where the captured graph has the ops they stand for:

==============  ==============================  ========================================================
function        stands for                      keeps for backward
==============  ==============================  ========================================================
silu_mul        ``silu(gate) * up`` (SwiGLU)    gate and up; silu(gate) computed again in backward (the
                                                ATen ops keep it too: one more tensor of the gate's size)
rms_normalize   ``x32 * rsqrt(mean(x32², -1)    x in its own (bf16) dtype; the ATen ops keep x32, its
                + eps)``, ``x32 = x.to(fp32)``  fp32 copy (twice the bytes), and rsqrt's [..., 1] result
                (RMSNorm's fp32 part)
==============  ==============================  ========================================================

Backward runs the ATen ops' own derivative formulas on the same values, so gradients are bit-identical to the ops'
own: ``silu_mul`` computes ``silu(gate)`` again (the same tensor bit for bit) and applies mul's and silu's
derivatives as autograd does; ``rms_normalize`` runs its ATen ops again from the kept x under autograd and takes
their gradient (the upcast is exact, every op deterministic: the same graph on the same values).  Under
torch.compile they are the ATen ops, for the compiler to choose what it saves::

    act = rt.silu_mul(gate, up)       # = aten.mul(aten.silu(gate), up)
    normed = rt.rms_normalize(x, 1e-06)   # [..., H] f32 from x [..., H] bf16
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


def _rms_normalize_ops(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The ATen ops transformers' RMSNorms (Llama, Qwen, Mistral) run in fp32, as the captured graph has them."""
    x32 = aten.to.dtype(x, torch.float32)
    mean = aten.mean.dim(aten.pow.Tensor_Scalar(x32, 2), [-1], True)
    return aten.mul.Tensor(x32, aten.rsqrt.default(aten.add.Tensor(mean, eps)))


class _RmsNormalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        ctx.eps = eps
        ctx.save_for_backward(x)
        return _rms_normalize_ops(x, eps)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():  # the same ops again from the kept x, and autograd's own gradient of them
            leaf = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(_rms_normalize_ops(leaf, ctx.eps), leaf, grad)
        return dx, None


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x.to(float32) * rsqrt(mean(x.to(float32)**2, -1, keepdim=True) + eps)``, keeping ``x`` (not its fp32 copy)
    for backward, which runs the ops again from it."""
    if torch.compiler.is_compiling():
        return _rms_normalize_ops(x, eps)
    return _RmsNormalize.apply(x, eps)
