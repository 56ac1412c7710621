"""A custom ``torch.autograd.Function`` keeps its backward: capture runs each call as an ``fxshard_fn`` custom op
(fxshard/capture/functions.py, fxshard/runtime/functions.py) whose gradient is the Function's own, the rank
files define the same op, and what cannot be carried exactly is refused naming the module and Function.
Training under tp=2 and pp=2 against one device: tests/test_capture_layouts.py (straight-through-fn cases)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxshard.capture.modelfile import load_model_file
from fxshard.capture.program import capture
from fxshard.driver import compile as compile_model
from fxshard.errors import CaptureError
from fxshard.ir.context import Layout
from fxshard.runtime.functions import TENSOR, autograd_function, op_name

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"
sys.path.insert(0, str(MODELS))

from ste_function import RoundStraightThrough  # noqa: E402


class Gate(torch.autograd.Function):
    """Two tensor inputs, one constant, two outputs; backward is not the forward's gradient and checks that
    ``needs_input_grad`` is the caller's."""

    @staticmethod
    def forward(ctx, x, w, scale):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return x * w, (x + w).sum(-1)

    @staticmethod
    def backward(ctx, g_prod, g_sum):
        x, w = ctx.saved_tensors
        gx = g_prod * ctx.scale + g_sum.unsqueeze(-1) if ctx.needs_input_grad[0] else None
        gw = (g_prod * x).sum(0, keepdim=True).expand_as(w) * 2 if ctx.needs_input_grad[1] else None
        return gx, gw, None


class Dirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + torch.rand_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class WithCount(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, grad, _count):
        return grad


class Applies(nn.Module):
    """``fc`` then ``call(h)``: the module a refusal must name is ``fc_act``."""

    def __init__(self, call):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.fc_act = _Call(call)

    def forward(self, x):
        return self.fc_act(self.fc(x))


class _Call(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, x):
        return self.call(x)


def _grads(fn, inputs):
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = (outs,) if isinstance(outs, torch.Tensor) else outs
    torch.manual_seed(5)
    loss = sum((o * torch.randn_like(o)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


@pytest.mark.parametrize("case", ["ste", "gate", "gate-w-frozen", "phimoe"])
def test_op_gradient_is_the_functions_backward(case):
    torch.manual_seed(0)
    x, w = torch.randn(3, 4), torch.randn(1, 4)
    if case == "ste":
        cls, module, args = RoundStraightThrough, "ste_function", (x, 4.0)
    elif case.startswith("gate"):
        cls, module, args = Gate, __name__, (x, w, 0.5)
    else:
        from transformers.models.phimoe.modeling_phimoe import PhimoeMultiplier

        scores, gates = torch.randn(3, 4), torch.randn(3, 4).softmax(-1)
        picked = torch.tensor([[1], [0], [3]])
        cls, module = PhimoeMultiplier, "transformers.models.phimoe.modeling_phimoe"
        args = (scores, gates.gather(-1, picked), picked, gates, torch.tensor([[1.0], [0.3333], [1.0]]))
    template = tuple(TENSOR if isinstance(a, torch.Tensor) else a for a in args)
    outputs = 2 if cls is Gate else 0
    op = autograd_function(op_name(module, cls.__qualname__, template, outputs), module, cls.__qualname__,
                           template, outputs)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]

    def through_op(*ts):
        if case == "gate-w-frozen":
            ts = (ts[0], ts[1].detach())
        return op(*ts)

    def through_function(*ts):
        it = iter(ts if case != "gate-w-frozen" else (ts[0], ts[1].detach()))
        return cls.apply(*[next(it) if t is TENSOR else t for t in template])

    got, want = _grads(through_op, tensors), _grads(through_function, tensors)
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    if case == "ste":  # the backward is not the forward's own gradient (0): the test can tell them apart
        assert not torch.equal(want[1][0], _grads(lambda t: torch.round(t * 4) / 4, tensors[:1])[1][0])


def test_capture_wraps_the_function_as_a_pointwise_op():
    program = capture(load_model_file(MODELS / "straight_through_fn.py"))
    (name, fop), = program.functions.items()
    assert (fop.module, fop.qualname, fop.template, fop.outputs, fop.pointwise) == \
        ("ste_function", "RoundStraightThrough", (TENSOR, 4.0), 0, True)
    assert fop.fqns == ("blocks.0", "blocks.1")
    calls = [n for n in program.gm.graph.nodes if getattr(n.target, "namespace", "") == "fxshard_fn"]
    assert len(calls) == 2 and all(torch.Tag.pointwise in n.target.tags for n in calls)
    assert not any(n.target is torch.ops.aten.round.default for n in program.gm.graph.nodes)


@pytest.mark.slow
def test_rank_files_define_the_op_and_keep_the_mlp_split(tmp_path):
    result = compile_model(MODELS / "straight_through_fn.py", Layout(tp=2), out=tmp_path,
                           plan={"blocks.*.fc_in": "colwise", "blocks.*.fc_out": "rowwise"})
    (name,) = result.ctx.program.functions
    assert result.manifest.custom_ops == {f"fxshard_fn::{name}": "ste_function"}
    source = (tmp_path / "rank_pp0_tp1.py").read_text()
    assert f"rt.autograd_function({name!r}, 'ste_function', 'RoundStraightThrough', (rt.TENSOR, 4.0), " \
           "outputs=0, pointwise=True)" in source
    assert f"torch.ops.fxshard_fn.{name}.default(" in source and "all_gather" not in source
    # a fresh interpreter has no fxshard_fn op until it loads the rank file (ste_function on its path)
    probe = ("import importlib.util, sys, torch\n"
             f"sys.path.insert(0, {str(MODELS)!r})\n"
             f"assert not hasattr(torch.ops.fxshard_fn, {name!r})\n"
             f"spec = importlib.util.spec_from_file_location('r', {str(tmp_path / 'rank_pp0_tp1.py')!r})\n"
             "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
             f"torch.ops.fxshard_fn.{name}.default\n")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


def test_a_function_with_a_reduction_is_not_pointwise():
    model = Applies(lambda h: Gate.apply(h, torch.ones(1, 16), 0.5)[0])
    program = capture(load_model_file(MODELS / "straight_through.py"), model=model,
                      inputs=(torch.randn(4, 16),))
    (fop,) = program.functions.values()
    assert fop.outputs == 2 and not fop.pointwise


def test_function_in_the_model_file_is_refused_naming_it():
    with pytest.raises(CaptureError, match=r"^blocks\.0: applies the custom torch\.autograd\.Function "
                                           r"RoundStraightThrough \(from straight_through\.py\).*defined in the "
                                           r"model file.*move the Function into a module the model file imports"):
        capture(load_model_file(MODELS / "straight_through.py"))


def _local_function():
    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad

    return Local


@pytest.mark.parametrize(("call", "found"), [
    (lambda h: Dirty.apply(h), r"Dirty .*changes an input in place \(mark_dirty\)"),
    (lambda h: Noisy.apply(h), r"Noisy .*draws no random numbers.*calls aten\.rand_like"),
    (lambda h: WithCount.apply(h)[0], r"WithCount .*tensor outputs, and its forward returns tuple of Tensor, int"),
    (lambda h: RoundStraightThrough.apply(h, scale=4.0),
     r"RoundStraightThrough .*keyword argument\(s\) scale; pass them positionally"),
    (lambda h: RoundStraightThrough.apply(h, torch.device("cpu")), r"RoundStraightThrough .*argument 1 is a device"),
    (lambda h: _local_function().apply(h), r"_local_function\.<locals>\.Local .*not \(defined inside a function\?\)"),
], ids=["mark-dirty", "random", "non-tensor-output", "keyword", "object-argument", "local"])
def test_what_cannot_be_wrapped_exactly_is_refused_naming_it(call, found):
    with pytest.raises(CaptureError, match=r"^fc_act: applies the custom torch\.autograd\.Function " + found):
        capture(load_model_file(MODELS / "straight_through.py"), model=Applies(call), inputs=(torch.randn(4, 16),))
