"""``fxshard run --compile`` on CPU: the compiled graphs' fp32 matrix products on oneDNN instead of torch's BLAS.

torch's x86 wheels multiply fp32 matrices (``aten.mm``, ``aten.addmm``: every linear layer, forward and both
backward products) with MKL's ``sgemm``.  MKL picks its code path by CPU vendor: on AMD processors it runs its
AVX2 kernels even where the core has AVX-512, while oneDNN, which the same wheels carry, JIT-compiles its kernels
for the instruction set the core reports.  On this project's CPU machines (AMD EPYC, AVX-512) oneDNN's fp32
product is 2.7x MKL's at the benchmark's shapes (512 rows, one thread: ``benchmarks/cpu_matmul.py``, which
measures it on whatever machine runs it).  Plain ``torch.compile`` keeps MKL: inductor calls oneDNN for linear
layers only in frozen inference graphs, whose weights are constants.

Exactness: both kernels compute each output element as a fp32 dot product, only the order of its partial sums
differs, so results differ in the last bits as any two BLAS builds do (relative 1e-6 per element at K=512); the
losses of a compiled run stay within 1e-6 of the eager run's (``tests/runtime/test_compiled.py``).  Every rank
takes the same kernel for every product, by this fixed rule and never by timing, so the replicated parameters
that tensor parallelism keeps on each rank stay identical.  ``--cpu-matmul torch`` keeps torch's kernel.

The rewrite is an inductor post-grad pass over the joint forward and backward graphs (``torch.compile``'s
``post_grad_custom_post_pass``): each fp32 CPU ``mm(a, b)`` and linear ``addmm(bias, a, b)`` becomes
``fxshard::onednn_mm(a, b, bias)``, an operator whose kernel is oneDNN's linear.  Products of fewer than 4M
multiply-adds stay on torch's kernel, which is faster there (``benchmarks/cpu_matmul.py``: 2 us against oneDNN's
18 us at 32x64x32, even at 128^3), as do products whose shape is symbolic, other dtypes and devices, and
``addmm`` with scaling or a bias that is not one row (torch already runs bf16 on oneDNN).  The rule depends on
shapes alone, the same on every rank.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

CPU_MATMULS = ("onednn", "torch")  # --cpu-matmul: the compiled fp32 CPU matrix products' kernel
MIN_MULTIPLY_ADDS = 1 << 22  # smaller products stay on torch's kernel: oneDNN's ~15 us call costs more than it saves
COUNTER = "fxshard_onednn_mm"  # torch._dynamo.utils.counters["inductor"][COUNTER]: the products rewritten so far


@torch.library.custom_op("fxshard::onednn_mm", mutates_args=())
def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` for 2-d fp32 CPU ``a`` [M, K], ``b`` [K, N] and ``bias`` [N], on oneDNN's linear kernel.

    >>> onednn_mm(torch.randn(4, 3), torch.randn(3, 2)).shape
    torch.Size([4, 2])
    """
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


@onednn_mm.register_fake
def _(a, b, bias=None):
    return a.new_empty((a.shape[0], b.shape[1]))


def onednn_available() -> bool:
    """Whether this torch build has oneDNN on CPU (the x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available()


class OneDNNMatmuls(CustomGraphPass):
    """The post-grad pass: each fp32 CPU ``mm`` and linear ``addmm`` of the graph with at least
    ``min_multiply_adds`` becomes :func:`onednn_mm`."""

    def __init__(self, min_multiply_adds: int):
        self.min_multiply_adds = min_multiply_adds

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._dynamo.utils import counters

        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            if not _fp32_cpu(node) or node.kwargs:  # addmm's beta or alpha: not a linear layer's product
                continue
            a_val, b_val = (arg.meta.get("val") for arg in node.args[-2:])
            if not takes_onednn(*a_val.shape, b_val.shape[1], self.min_multiply_adds):
                continue
            bias, (a, b) = (None, node.args) if node.target is aten.mm.default else (node.args[0], node.args[1:])
            if bias is not None and not _one_row(bias, node):
                continue
            with graph.inserting_before(node):
                product = graph.call_function(torch.ops.fxshard.onednn_mm.default, (a, b, bias))
            product.meta.update(node.meta)
            node.replace_all_uses_with(product)
            graph.erase_node(node)
            # inductor's own counters: its graph cache replays them when it serves a graph this pass rewrote
            counters["inductor"][COUNTER] += 1

    def uuid(self) -> bytes:
        """Inductor's cache key for graphs this pass rewrote: this file's contents and the threshold."""
        return get_hash_for_files((__file__,)) + str(self.min_multiply_adds).encode()


def takes_onednn(m, k, n, min_multiply_adds: int | None = None) -> bool:
    """Whether an fp32 CPU product [m, k] @ [k, n] runs on oneDNN under ``--cpu-matmul onednn``: a static shape of
    at least ``min_multiply_adds`` (:data:`MIN_MULTIPLY_ADDS`)."""
    least = MIN_MULTIPLY_ADDS if min_multiply_adds is None else min_multiply_adds
    return all(isinstance(d, int) for d in (m, k, n)) and m * k * n >= least


def _fp32_cpu(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype == torch.float32


def _one_row(bias: torch.fx.Node, node: torch.fx.Node) -> bool:
    val = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == node.meta["val"].shape[1]


def onednn_products() -> int:
    """How many matrix products of the graphs this process compiled (or took from inductor's cache) run on oneDNN."""
    from torch._dynamo.utils import counters

    return counters["inductor"][COUNTER]


def inductor_options(cpu_matmul: str) -> dict:
    """``torch.compile``'s inductor options for ``--cpu-matmul``: the pass above for ``onednn`` (where the build has
    oneDNN), none for ``torch``."""
    if cpu_matmul not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul {cpu_matmul!r}: expected one of {', '.join(CPU_MATMULS)}")
    if cpu_matmul == "onednn" and onednn_available():
        return {"post_grad_custom_post_pass": OneDNNMatmuls(MIN_MULTIPLY_ADDS)}
    return {}
