"""The ops of fxshard.runtime.activations compute the ATen ops they stand for bit for bit, forward and backward."""

from __future__ import annotations

import pytest
import torch

from fxshard.runtime import activations as rta

aten = torch.ops.aten


def _values_and_grads(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_then_mul_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(3, 5, 16, generator=g).to(dtype) * 3 for _ in range(3))
    ours = _values_and_grads(rta.silu_mul, (gate, up), grad)
    theirs = _values_and_grads(lambda a, b: aten.mul.Tensor(aten.silu.default(a), b), (gate, up), grad)
    assert torch.equal(ours[0], theirs[0])
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a, b)


def test_silu_mul_keeps_gate_and_up_not_silu():
    gate, up = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        rta.silu_mul(gate, up)
    assert len(kept) == 2 and kept[0] is gate and kept[1] is up


def _rms_ops(x, eps=1e-6):
    x32 = aten.to.dtype(x, torch.float32)
    return aten.mul.Tensor(x32, aten.rsqrt.default(aten.add.Tensor(aten.mean.dim(aten.pow.Tensor_Scalar(x32, 2), [-1],
                                                                                  True), eps)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_normalize_is_the_fp32_ops_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 7, 48, generator=g) * 4).to(dtype)
    grad = torch.randn(2, 7, 48, generator=g)
    ours = _values_and_grads(lambda t: rta.rms_normalize(t, 1e-6), (x,), grad)
    theirs = _values_and_grads(_rms_ops, (x,), grad)
    assert ours[0].dtype == torch.float32 and torch.equal(ours[0], theirs[0])
    assert ours[1][0].dtype == dtype and torch.equal(ours[1][0], theirs[1][0])


def test_rms_normalize_keeps_x_alone():
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        rta.rms_normalize(x, 1e-6)
    assert len(kept) == 1 and kept[0] is x
