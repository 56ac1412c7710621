"""Activation recompute (--recompute): what the generated code says, what is refused, and that a recomputed
block trains exactly as the block run once (the layouts themselves are trained against one device in
tests/test_training_layouts.py and tests/test_dropout_layouts.py)."""

from __future__ import annotations

import pytest
import torch

from fxshard.driver import compile as compile_model
from fxshard.errors import LayoutError
from fxshard.ir.context import Layout
from fxshard.runtime import random as rt_random
from fxshard.runtime.recompute import recompute


def test_full_recompute_wraps_every_block_call_and_says_so(samples):
    code = compile_model(samples / "llama.py", Layout(tp=2, pp=2, recompute="full")).sources["rank_pp1_tp0.py"]
    calls = [ln.strip() for ln in code.splitlines() if "rt.recompute(" in ln]
    assert len(calls) == 2
    assert all(c.startswith(f"model_layers_{i}_hidden_states = rt.recompute(self.model_layers_{i}, ")
               for c, i in zip(calls, (2, 3), strict=True))
    assert all("keep=" not in c and "keeps its inputs, recomputes its forward in backward" in c for c in calls)
    assert "# recompute: full: model.layers.2, model.layers.3 keep only their inputs for backward" in code
    assert "recompute=full" in code.splitlines()[3]  # the layout line


def test_selective_recompute_keeps_the_matmuls(samples):
    code = compile_model(samples / "gpt.py", Layout(tp=2, recompute="selective")).sources["rank_pp0_tp0.py"]
    calls = [ln for ln in code.splitlines() if "rt.recompute(" in ln]
    assert len(calls) == 8 and all('keep="matmuls"' in c for c in calls)


def test_no_recompute_calls_blocks_directly(samples):
    code = compile_model(samples / "gpt.py", Layout(tp=2)).sources["rank_pp0_tp0.py"]
    assert "rt.recompute" not in code and "blocks_0_out = self.blocks_0(add)" in code


def test_a_model_without_repeated_blocks_is_refused(models):
    with pytest.raises(LayoutError, match=r"--recompute full: Model has no repeated blocks .* drop --recompute"):
        compile_model(models / "mlp.py", Layout(recompute="full"))


def test_an_unknown_mode_is_refused():
    with pytest.raises(LayoutError, match=r"--recompute must be one of none, selective, full, auto, got 'some'"):
        Layout(recompute="some")


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = rt_random.dropout(torch.tanh(self.a(x)), 0.3, site=0)
        return x + self.b(h.softmax(-1))


@pytest.mark.parametrize("keep", ["inputs", "matmuls"])
def test_recomputed_gradients_equal_the_plain_ones_even_after_the_dropout_key_moved_on(keep):
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(4, 8, requires_grad=True)
    rt_random.begin_batch(seed=0, number=3)
    plain = block(x)
    grads = torch.autograd.grad(plain.sum(), [x, *block.parameters()])
    rt_random.begin_batch(seed=0, number=3)
    again = recompute(block, x, keep=keep)
    rt_random.begin_microbatch(1)  # a pipeline schedule computes the next microbatch before this backward
    rt_random.begin_batch(seed=0, number=4)
    recomputed = torch.autograd.grad(again.sum(), [x, *block.parameters()])
    assert torch.equal(plain, again)
    for g, r in zip(grads, recomputed, strict=True):
        assert torch.equal(g, r)


def test_an_unknown_keep_is_refused():
    with pytest.raises(ValueError, match="keep='everything'; expected one of inputs, matmuls"):
        recompute(_Block(), torch.randn(2, 8), keep="everything")
