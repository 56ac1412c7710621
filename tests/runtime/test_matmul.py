"""``--cpu-matmul``: the compiled graphs' fp32 CPU matrix products on oneDNN (:mod:`fxshard.runtime.matmul`).

One process, a three-layer MLP compiled as ``fxshard run --compile`` compiles a rank's module: every product of
the forward and both backward products of each layer are rewritten (and counted, also when inductor's cache
serves the graph), the loss and every gradient equal the eager ones within 1e-6 relative, and ``torch`` (or a
dtype other than fp32) leaves torch's kernel in place.  The distributed runs are ``tests/runtime/test_compiled.py``.
"""

from __future__ import annotations

import pytest
import torch

from fxshard.errors import OptionError
from fxshard.runtime.compiled import compile_module
from fxshard.runtime.matmul import onednn_available, onednn_products
from fxshard.train.options import RunOptions, check_run_options

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
RTOL = 1e-6  # as compiled vs eager in tests/runtime/test_compiled.py


def _mlp(dtype=torch.float32) -> torch.nn.Module:
    """On 256 rows: 4M multiply-adds in the first layer's products, 16M in the second's, 1M in the last's."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256, bias=False),
                               torch.nn.Tanh(), torch.nn.Linear(256, 16)).to(dtype)


def _step(module, x):
    module.zero_grad(set_to_none=True)
    loss = module(x).float().pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad for p in module.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _compiled_step(cpu_matmul: str, dtype=torch.float32):
    torch._dynamo.reset()
    x = torch.randn(4, 64, 64, dtype=dtype, generator=torch.Generator().manual_seed(1))
    eager, compiled = _mlp(dtype), compile_module(_mlp(dtype), cpu_matmul=cpu_matmul)
    before = onednn_products()
    got = _step(compiled, x)
    return _step(eager, x), got, onednn_products() - before


def test_onednn_takes_every_fp32_product_and_matches_eager():
    (loss, grads), (c_loss, c_grads), rewritten = _compiled_step("onednn")
    # the first layer's forward and weight gradient (its input needs none) and the second's three products; the
    # last layer's three, of 1M multiply-adds each, stay on torch's kernel, which is faster there
    assert rewritten == 2 + 3
    assert _rel(c_loss, loss) <= RTOL
    assert all(_rel(c, g) <= RTOL for c, g in zip(c_grads, grads, strict=True))


def test_torch_kernel_and_other_dtypes_are_left_alone():
    (loss, _), (c_loss, _), rewritten = _compiled_step("torch")
    assert rewritten == 0 and _rel(c_loss, loss) <= RTOL
    (loss, _), (c_loss, _), rewritten = _compiled_step("onednn", torch.bfloat16)  # torch's bf16 is oneDNN already
    assert rewritten == 0 and _rel(c_loss, loss) <= 1e-2


def test_cpu_matmul_option_reaches_every_rank_and_refuses_unknown_kernels(tmp_path):
    argv = RunOptions(cpu_matmul="torch").argv(tmp_path)
    assert argv[argv.index("--cpu-matmul") + 1] == "torch"
    with pytest.raises(OptionError, match=r"--cpu-matmul mkl: expected one of onednn, torch"):
        check_run_options(tmp_path, RunOptions(cpu_matmul="mkl"), say=lambda *_: None)
