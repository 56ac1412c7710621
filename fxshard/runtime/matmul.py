"""``fxshard run --compile`` on CPU: the compiled graphs' large fp32 matrix products on oneDNN instead of MKL.

torch's x86 wheels multiply fp32 matrices (``aten.mm``, ``aten.addmm``: every linear layer, forward and both
backward products) with MKL's ``sgemm``. MKL picks its code path by CPU vendor: on an AMD core with AVX-512 its
``sgemm`` runs at about the AVX2 rate (115 to 120 GFLOP/s on one core at 512x512x1024, measured on an AMD EPYC with
AVX-512), while oneDNN, which the same wheels carry and which JIT-compiles its kernels for the instruction set the
core reports, runs the same products at 240 to 265: over one tensor-parallel step's products of the benchmark GPT it
took 0.47 to 0.51 of MKL's time there.  On an AMD EPYC without AVX-512 (AVX2 only) the two take the same path and
MKL is the faster: oneDNN took 1.29 to 1.33 of MKL's time over the same products (``python -m benchmarks.run --only
matmul``, whose first line names the CPU; ``benchmarks/results/latest.md``).  No Intel machine was measured, where
MKL takes its AVX-512 path and the gain should be small.  Hence ``--cpu-matmul auto``, the default
(:func:`chosen_kernel`): oneDNN on an AMD CPU with AVX-512, torch's kernel anywhere else; every rank agrees on one
(:func:`agreed_kernel`).  Plain ``torch.compile`` keeps MKL: inductor calls oneDNN for linear layers only in frozen
inference graphs, whose weights are constants.

Exactness: both kernels compute each output element as an fp32 dot product and differ only in the order of its
partial sums.  At the benchmark's shapes (K up to 1024) each lies within 1.1e-6 (oneDNN) and 5e-7 (MKL) of an
fp64 product, relative to that product's largest element; the losses of a compiled run stay within 1e-6 of the
eager run's (``tests/runtime/test_compiled.py``).  Every rank takes the same kernel for every product, by a rule
on shapes alone and never by timing, so the replicated parameters tensor parallelism keeps on each rank stay
identical.  ``--cpu-matmul torch`` keeps torch's kernel; ``onednn`` takes oneDNN on any CPU.

The rewrite (:func:`rewrite_products`) runs as inductor's post-grad pass over the forward and the backward graph
(:func:`fxshard.runtime.compiled.inductor_options`): each fp32 CPU ``mm(a, b)`` and linear ``addmm(bias, a, b)`` of
at least :data:`MIN_MULTIPLY_ADDS` becomes ``fxshard::onednn_mm(a, b, bias)``, an operator whose kernel is oneDNN's
linear. Smaller products stay on MKL, faster there (the crossover table of ``benchmarks/cpu_matmul.py``: on the
AVX-512 machine MKL 3 us against oneDNN's 21 us at 32x64x32, about even at 2M multiply-adds, oneDNN ahead from 4M),
as do products of symbolic shape (the rows an expert gets under ``--ep``), batched products (``bmm``: attention),
other dtypes (torch runs bf16 on oneDNN already) and devices, and ``addmm`` with scaling or an addend that is not
one bias row (inductor folds a residual add into an ``addmm`` of [M, N] addend: it stays on MKL). Importing this
module registers the operator; the pass that calls it is ``fxshard.runtime.compiled``'s.
"""

from __future__ import annotations

import torch

CPU_MATMULS = ("auto", "onednn", "torch")  # --cpu-matmul: the kernel of the compiled fp32 CPU matrix products
MIN_MULTIPLY_ADDS = 1 << 22  # smaller products stay on MKL: oneDNN's ~20 us per call costs more than it saves
COUNTER = "fxshard_onednn_mm"  # torch._dynamo.utils.counters["inductor"][COUNTER]: the products rewritten so far


@torch.library.custom_op("fxshard::onednn_mm", mutates_args=())
def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` for 2-d fp32 CPU ``a`` [M, K], ``b`` [K, N] and ``bias`` [N], on oneDNN's linear kernel.
    ``a`` and ``b`` may have any strides (a transposed gradient, a weight read as ``w.T``); the bias is made
    contiguous, as the kernel reads it.

    >>> onednn_mm(torch.randn(4, 3), torch.randn(3, 2)).shape
    torch.Size([4, 2])
    """
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), None if bias is None else bias.contiguous(), "none", [], "")


@onednn_mm.register_fake
def _(a, b, bias=None):
    return a.new_empty((a.shape[0], b.shape[1]))


def onednn_available() -> bool:
    """Whether this torch build has oneDNN on CPU (the x86 and aarch64 wheels do) and it is not turned off
    (``torch.backends.mkldnn.enabled``).

    >>> onednn_available()
    True
    """
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def cpu_vendor() -> str:
    """The CPU's vendor as Linux reports it (``AuthenticAMD``, ``GenuineIntel``), or ``""`` where it is unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def chosen_kernel(cpu_matmul: str, capability: str | None = None, vendor: str | None = None) -> str:
    """The kernel ``--cpu-matmul`` names: ``auto`` is ``onednn`` where MKL leaves the core's vector width unused (an
    AMD CPU whose torch capability is AVX-512 or wider: MKL takes its AVX2 path there) and ``torch`` anywhere
    else, where MKL was as fast or faster (the module's docstring).  ``capability`` and ``vendor`` default to this
    machine's (``torch.backends.cpu.get_cpu_capability()``, :func:`cpu_vendor`).

    >>> chosen_kernel("auto", "AVX512", "AuthenticAMD"), chosen_kernel("auto", "AVX2", "AuthenticAMD")
    ('onednn', 'torch')
    >>> chosen_kernel("auto", "AVX512", "GenuineIntel"), chosen_kernel("onednn", "AVX2", "AuthenticAMD")
    ('torch', 'onednn')
    """
    if cpu_matmul != "auto":
        return cpu_matmul
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    vendor = cpu_vendor() if vendor is None else vendor
    wide = capability.startswith(("AVX512", "AMX"))
    return "onednn" if wide and vendor == "AuthenticAMD" and onednn_available() else "torch"


def agreed_kernel(cpu_matmul: str) -> str:
    """:func:`chosen_kernel` on every rank of the initialized default process group, agreed: ``onednn`` only where
    every rank chose it (ranks on hosts of other CPUs would otherwise round replicated products differently).
    Without a process group, this process's choice."""
    import torch.distributed as dist

    choice = chosen_kernel(cpu_matmul)
    if cpu_matmul != "auto" or not dist.is_initialized() or dist.get_backend() != "gloo":
        return choice
    vote = torch.tensor([choice == "onednn"], dtype=torch.int32)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    return "onednn" if vote.item() else "torch"


def takes_onednn(m, k, n, min_multiply_adds: int | None = None) -> bool:
    """Whether an fp32 CPU product [m, k] @ [k, n] runs on oneDNN under ``--cpu-matmul onednn``: a static, non-empty
    shape of at least ``min_multiply_adds`` (default :data:`MIN_MULTIPLY_ADDS`) multiply-adds.

    >>> takes_onednn(512, 512, 1024), takes_onednn(32, 64, 32)
    (True, False)
    """
    least = MIN_MULTIPLY_ADDS if min_multiply_adds is None else min_multiply_adds
    return all(isinstance(d, int) for d in (m, k, n)) and m * k * n >= max(least, 1)


def rewrite_products(graph: torch.fx.Graph, min_multiply_adds: int) -> int:
    """Make each fp32 CPU ``mm`` and linear ``addmm`` of an ATen ``graph`` that :func:`takes_onednn` a call of
    :func:`onednn_mm`, counted under :data:`COUNTER`; return how many::

        rewrite_products(gm.graph, MIN_MULTIPLY_ADDS)   # in inductor's post-grad pass: 9
    """
    from torch._dynamo.utils import counters

    aten, rewritten = torch.ops.aten, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
            continue
        if not _fp32_cpu(node) or node.kwargs:  # addmm's beta or alpha: not a linear layer's product
            continue
        bias, (a, b) = (None, node.args) if node.target is aten.mm.default else (node.args[0], node.args[1:])
        a_val, b_val = a.meta["val"], b.meta["val"]
        if not takes_onednn(*a_val.shape, b_val.shape[1], min_multiply_adds):
            continue
        if bias is not None and not _one_row(bias, node):
            continue
        with graph.inserting_before(node):
            product = graph.call_function(torch.ops.fxshard.onednn_mm.default, (a, b, bias))
        product.meta.update(node.meta)
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        rewritten += 1
    # inductor's own counters: its graph cache replays them when it serves a graph this rewrote
    counters["inductor"][COUNTER] += rewritten
    return rewritten


def onednn_products() -> int:
    """How many matrix products of the graphs this process compiled (or took from inductor's cache) run on oneDNN::

        onednn_products()   # after a compiled step of the medium benchmark GPT at tp=2: 75
    """
    from torch._dynamo.utils import counters

    return counters["inductor"][COUNTER]


def _fp32_cpu(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype == torch.float32


def _one_row(bias, node: torch.fx.Node) -> bool:
    val = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == node.meta["val"].shape[1]
