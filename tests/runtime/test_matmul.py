"""``--cpu-matmul``: the compiled graphs' fp32 CPU matrix products on oneDNN (:mod:`fxshard.runtime.matmul`).

One process, a three-layer MLP compiled as ``fxshard run --compile`` compiles a rank's module: the products of
4M multiply-adds and more are rewritten and the smaller ones left alone, counted the same when inductor's cache
serves the graphs, the loss and every gradient equal the eager ones within 1e-6 relative, and ``torch`` (or a
dtype other than fp32) leaves torch's kernel in place.  The operator itself is checked against ``torch.addmm`` on
operands and biases of every stride a graph can hand it.  The distributed runs are ``tests/runtime/test_compiled.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_in_process import fxshard

from fxshard.errors import OptionError
from fxshard.runtime.compiled import compile_module
from fxshard.runtime.matmul import onednn_available, onednn_mm, onednn_products
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
    torch._dynamo.reset()  # the next compile starts over: its graphs come from inductor's cache where it has them
    x = torch.randn(4, 64, 64, dtype=dtype, generator=torch.Generator().manual_seed(1))
    eager, compiled = _mlp(dtype), compile_module(_mlp(dtype), cpu_matmul=cpu_matmul)
    before = onednn_products()
    got = _step(compiled, x)
    return _step(eager, x), got, onednn_products() - before


@pytest.mark.slow  # inductor compiles the step twice: 12 to 18 s
def test_onednn_takes_the_large_fp32_products_and_matches_eager():
    from torch._dynamo.utils import counters

    (loss, grads), (c_loss, c_grads), rewritten = _compiled_step("onednn")
    # the first layer's forward and weight gradient (its input needs none) and the second's three products; the
    # last layer's three, of 1M multiply-adds each, stay on torch's kernel, which is faster there
    assert rewritten == 2 + 3
    assert _rel(c_loss, loss) <= RTOL
    assert all(_rel(c, g) <= RTOL for c, g in zip(c_grads, grads, strict=True))
    # compiled again from scratch: inductor serves both graphs from its cache, where the pass does not run, and
    # replays the count it recorded with them
    hits = counters["inductor"]["fxgraph_cache_hit"]
    _, (again, _), recounted = _compiled_step("onednn")
    assert counters["inductor"]["fxgraph_cache_hit"] >= hits + 2 and recounted == rewritten and again == c_loss


def test_onednn_mm_equals_addmm_on_every_stride():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(48, 64, generator=g), torch.randn(32, 64, generator=g)
    operands = {"x @ w.T": (x, w.t()), "x.T[:, :32] @ x[:32]": (x.t()[:, :32], x[:32]),
                "sliced": (x[::2], w.t()), "expanded": (x[:1].expand(48, 64), w.t())}
    plain = torch.randn(96, generator=g)
    biases = {"none": None, "contiguous": plain[:32], "offset": plain[5:37], "stride 2": plain[::3],
              "stride 0": plain[:1].expand(32)}
    for name, (a, b) in operands.items():
        for kind, bias in biases.items():
            if bias is not None and bias.shape[0] != b.shape[1]:
                continue
            want = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
            assert _rel(onednn_mm(a, b, bias), want) <= RTOL, (name, kind)


@pytest.mark.slow  # two inductor compiles
def test_torch_kernel_and_other_dtypes_are_left_alone():
    (loss, _), (c_loss, _), rewritten = _compiled_step("torch")
    assert rewritten == 0 and _rel(c_loss, loss) <= RTOL
    (loss, _), (c_loss, _), rewritten = _compiled_step("onednn", torch.bfloat16)  # torch's bf16 is oneDNN already
    assert rewritten == 0 and _rel(c_loss, loss) <= 1e-2


def test_cpu_matmul_option_reaches_every_rank_and_refuses_unknown_kernels(tmp_path):
    argv = RunOptions(cpu_matmul="torch").argv(tmp_path)
    assert argv[argv.index("--cpu-matmul") + 1] == "torch"
    with pytest.raises(OptionError, match=r"--cpu-matmul mkl: expected one of auto, onednn, torch"):
        check_run_options(tmp_path, RunOptions(cpu_matmul="mkl"), say=lambda *_: None)
    model = Path(__file__).resolve().parents[1] / "models" / "tiny_gpt.py"
    verify = fxshard("verify", model, "--tp", "2", "--compile", "--cpu-matmul", "mkl")  # refused before it compiles
    said = verify.stdout + verify.stderr
    assert verify.returncode != 0 and "--cpu-matmul mkl: expected one of auto, onednn, torch" in said


def _vote(rank: int, world: int) -> str:
    from fxshard.runtime import matmul

    matmul.chosen_kernel = lambda cpu_matmul: "onednn" if rank == 0 else "torch"  # rank 1 stands on another CPU
    return matmul.agreed_kernel("auto")


@pytest.mark.distributed
def test_auto_takes_onednn_only_where_every_rank_chose_it():
    from fxshard.testing import spawn

    assert spawn(_vote, 2) == ["torch", "torch"]  # one kernel everywhere: replicated products round alike
