"""The fp32 matrix products of one tensor-parallel training step, on torch's kernel (MKL) and on oneDNN.

``fxshard run --compile`` on CPU rewrites each fp32 ``mm``/``addmm`` of the compiled graphs into oneDNN's linear
kernel (``--cpu-matmul onednn``, :mod:`fxshard.runtime.matmul`); eager code, hand-written or generated, and plain
``torch.compile`` call torch's ``sgemm``, MKL in the x86 wheels.  This part measures the two kernels on the very
products one rank of ``benchmarks/models/gpt.py`` computes per step at tp=2 (q, k, v and fc_in column-wise,
o_proj and fc_out row-wise, the LM head over half the vocabulary; each one's forward product and its input and
weight gradients, the first as ``x @ w.T``, the others ``g @ w`` and ``g.T @ x`` with the strides autograd gives
them), in one process with one thread, the two kernels interleaved product by product.  It says how much of the
``fxshard --compile`` row of the step-time table is the kernel rather than the compilation, on the machine that
runs it, and how far the two kernels' results are apart (the order of a dot product's partial sums).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

from benchmarks.common import markdown_table
from benchmarks.tp_step import TP

KERNELS = ("torch (MKL)", "oneDNN")


def products(config: dict, tp: int = TP) -> Counter:
    """One rank's fp32 products per step, as (kind, M, K, N) -> how many: ``forward`` [M,K]@[K,N] and its
    ``input grad`` and ``weight grad``."""
    tokens, hidden, vocab = config["batch"] * config["seq"], config["hidden"], config["vocab"]
    linears = [(hidden, hidden // tp)] * 3 + [(hidden // tp, hidden)]  # q, k, v; o_proj
    linears += [(hidden, 4 * hidden // tp), (4 * hidden // tp, hidden)]  # fc_in, fc_out
    out = Counter()
    for k, n in linears * config["layers"] + [(hidden, vocab // tp)]:  # and the LM head
        out[("forward", tokens, k, n)] += 1
        out[("input grad", tokens, n, k)] += 1
        out[("weight grad", n, tokens, k)] += 1
    return out


def _operands(kind: str, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands with autograd's strides: a weight [N,K] read transposed, a gradient read transposed."""
    g = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    if kind == "forward":  # x @ w.T
        return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).t()
    if kind == "input grad":  # g @ w: w is [out, in] = [K, N] here
        return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    return torch.randn(k, m, generator=g).t(), torch.randn(k, n, generator=g)  # g.T @ x


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


CROSSOVER = [(32, 64, 32), (64, 64, 64), (128, 128, 64), (128, 128, 128), (128, 256, 128), (256, 256, 128),
             (256, 256, 256)]  # forward products [M,K] @ [K,N] from 64K to 16M multiply-adds, around the threshold


def run(sizes: list[str], rounds: int, log=print) -> dict:
    """Both kernels on each product of each size's step and on the :data:`CROSSOVER` shapes, with one thread."""
    from fxshard.runtime.matmul import MIN_MULTIPLY_ADDS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [_model(size, rounds, log) for size in sizes]
        crossover = [dict(shape=[m, k, n], **_both(*_operands("forward", m, k, n), rounds)) for m, k, n in CROSSOVER]
    finally:
        torch.set_num_threads(threads)
    return {"rounds": rounds, "min_multiply_adds": MIN_MULTIPLY_ADDS, "models": models, "crossover": crossover}


def _both(a: torch.Tensor, b: torch.Tensor, rounds: int) -> dict:
    """``a @ b`` on both kernels, alternately after two untimed rounds: medians (ms), difference from fp64."""
    from fxshard.runtime.matmul import onednn_mm

    calls = {"torch (MKL)": lambda: torch.mm(a, b), "oneDNN": lambda: onednn_mm(a, b)}
    times = {name: [] for name in KERNELS}
    for r in range(rounds + 2):
        for name in KERNELS if r % 2 else KERNELS[::-1]:
            t = _seconds(calls[name])
            if r >= 2:
                times[name].append(t)
    ref = torch.mm(a.double(), b.double())
    return {"median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
            "diff_vs_fp64": {name: ((calls[name]().double() - ref).abs().max() / ref.abs().max()).item()
                             for name in KERNELS}}


def _model(size: str, rounds: int, log) -> dict:
    from benchmarks.models.gpt import SIZES
    from fxshard.runtime.matmul import takes_onednn

    rows = [dict(kind=kind, shape=[m, k, n], count=count,
                 compiled_on="oneDNN" if takes_onednn(m, k, n) else "torch (MKL)",
                 **_both(*_operands(kind, m, k, n), rounds))
            for (kind, m, k, n), count in sorted(products(SIZES[size]).items())]
    total = {name: sum(r["median_ms"][name] * r["count"] for r in rows) for name in KERNELS}
    total["--compile"] = sum(r["median_ms"][r["compiled_on"]] * r["count"] for r in rows)
    log(f"cpu_matmul {size}: {sum(r['count'] for r in rows)} products per step, MKL {total['torch (MKL)']:.1f} ms, "
        f"oneDNN {total['oneDNN']:.1f} ms, as --compile takes them {total['--compile']:.1f} ms")
    return {"size": size, "config": SIZES[size], "tp": TP, "products": rows, "step_ms": total,
            "onednn_products": sum(r["count"] for r in rows if r["compiled_on"] == "oneDNN"),
            "compiled/torch": total["--compile"] / total["torch (MKL)"]}


def millions(n: int) -> str:
    """``n`` multiply-adds as the tables write them: ``millions(1 << 22)`` is ``"4M"``."""
    return f"{n / 2**20:g}M"


def markdown(results: dict) -> str:
    least = millions(results["min_multiply_adds"])
    rows = []
    for r in results["models"]:
        c, totals = r["config"], r["step_ms"]
        worst = {name: max(p["diff_vs_fp64"][name] for p in r["products"]) for name in KERNELS}
        rows.append([f"{r['size']}: {c['layers']}×{c['hidden']}, vocab {c['vocab']}, {c['batch']}×{c['seq']} tokens",
                     sum(p["count"] for p in r["products"]), f"{totals['torch (MKL)']:.1f}", f"{totals['oneDNN']:.1f}",
                     r["onednn_products"], f"{totals['--compile']:.1f}", f"**{r['compiled/torch']:.3f}**",
                     f"{worst['torch (MKL)']:.1e}", f"{worst['oneDNN']:.1e}"])
    header = ["model (one rank at tp=2)", "fp32 products per step", "all on torch's kernel (MKL): ms per step",
              "all on oneDNN: ms per step", f"on oneDNN under --compile ({least} multiply-adds and more)",
              "as --compile takes them: ms per step", "--compile's ÷ MKL",
              "MKL: largest difference from fp64, relative", "oneDNN: largest difference from fp64, relative"]
    cross = [[" × ".join(map(str, x["shape"])), millions(x["shape"][0] * x["shape"][1] * x["shape"][2]),
              f"{x['median_ms']['torch (MKL)'] * 1e3:.1f}", f"{x['median_ms']['oneDNN'] * 1e3:.1f}",
              f"**{x['median_ms']['oneDNN'] / x['median_ms']['torch (MKL)']:.2f}**"] for x in results["crossover"]]
    return ("One rank's fp32 matrix products per training step at tp=2 (forward, input and weight gradients of every "
            "linear layer and the LM head; attention's batched products are not among them), each timed on both "
            f"kernels alternately in one process with one thread, {results['rounds']} times; the medians summed over "
            f"the step.  `fxshard --compile` runs the products of {least} multiply-adds and more on oneDNN "
            "(`--cpu-matmul onednn`, the default), the smaller ones on torch's kernel; eager code and plain "
            "torch.compile run all of them on torch's MKL `sgemm`.  The difference from an fp64 product, relative to "
            "its largest element, is each kernel's own rounding.\n\n" + markdown_table(header, rows) +
            f"\n\nWhere the threshold comes from: single forward products around {least} multiply-adds, same "
            "timing.\n\n" + markdown_table(["M × K × N", "multiply-adds", "MKL µs", "oneDNN µs",
                                            "oneDNN ÷ MKL"], cross))
