"""The runtime's fp8 linear is torchao's float8 training recipe, bit for bit, on one device."""

from __future__ import annotations

import copy

import pytest
import torch

from fxshard.runtime.fp8 import RECIPES, amax_elements, fp8_linear, fp8_module, fp8_reference

torchao_float8 = pytest.importorskip("torchao.float8")


def _pair(recipe: str, dtype: torch.dtype, bias: bool):
    torch.manual_seed(0)
    ours = torch.nn.Linear(48, 32, bias=bias).to(dtype)
    theirs = torchao_float8.convert_to_float8_training(
        torch.nn.Sequential(copy.deepcopy(ours)), config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe))[0]
    return ours, theirs


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fp8_linear_is_torchaos_float8_linear_bit_for_bit(recipe, dtype, bias):
    ours, theirs = _pair(recipe, dtype, bias)
    assert type(theirs).__name__ == "Float8Linear"
    x = (torch.randn(3, 16, 48) * torch.linspace(0.01, 30, 48)).to(dtype)  # rows and columns of unlike ranges
    grad = (torch.randn(3, 16, 32) * 1e-3).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = fp8_linear(xa, ours.weight, ours.bias, recipe)
    yb = theirs(xb)
    assert ya.dtype == yb.dtype == dtype
    ya.backward(grad)
    yb.backward(grad)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ours.weight.grad, theirs.weight.grad)
    if bias:
        assert torch.equal(ours.bias.grad, theirs.bias.grad)
    # and it is fp8, not the high-precision product
    assert not torch.equal(ya, torch.nn.functional.linear(x, ours.weight, ours.bias))


def test_a_frozen_weight_gets_no_gradient_and_the_input_the_same_one():
    ours, theirs = _pair("tensorwise", torch.bfloat16, False)
    ours.weight.requires_grad_(False)
    x = torch.randn(8, 48, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    fp8_linear(xa, ours.weight).sum().backward()
    theirs(xb).sum().backward()
    assert ours.weight.grad is None
    assert torch.equal(xa.grad, xb.grad)


def test_which_modules_compute_in_fp8():
    linear = torch.nn.Linear(64, 128)
    assert fp8_module("model.layers.0.mlp.up_proj", linear)
    assert not fp8_module("lm_head", linear)  # the vocabulary projection stays high precision (torchtitan's filter)
    assert not fp8_module("base_model.model.layers.0.q_proj.lora_A.default", linear)  # LoRA adapters too
    assert fp8_module("base_model.model.layers.0.q_proj.base_layer", linear)  # LoRA's base computes in fp8
    assert not fp8_module("proj", torch.nn.Linear(64, 100))  # torch._scaled_mm's multiples of 16
    assert not fp8_module("conv", torch.nn.Conv1d(16, 16, 1))


def test_the_reference_swaps_the_forward_and_keeps_the_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    names = [n for n, _ in model.named_parameters()]
    assert fp8_reference(model, "tensorwise") == ["0", "2"]
    assert [n for n, _ in model.named_parameters()] == names
    x = torch.randn(4, 32)
    assert torch.equal(model(x), fp8_linear(torch.relu(fp8_linear(x, model[0].weight, model[0].bias)),
                                            model[2].weight, model[2].bias))


def test_amax_buffers_are_small():
    assert amax_elements("tensorwise", 4096, 8192, 8192, "forward") == 2
    assert amax_elements("tensorwise", 4096, 8192, 8192, "backward") == 1
    assert amax_elements("rowwise", 4096, 8192, 1024, "forward", "in") == 4096 + 1024  # per output feature: spans
    assert amax_elements("rowwise", 4096, 8192, 1024, "forward", "out") == 4096  # output features split: own
    assert amax_elements("rowwise", 4096, 8192, 1024, "backward", "out") == 4096 + 8192
    assert amax_elements("rowwise", 4096, 8192, 1024, "backward", "in") == 4096
