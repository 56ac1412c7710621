"""``fxshard run --compile``: a generated module's forward, and so its backward, through ``torch.compile``.

The whole forward is one graph (inductor fuses across blocks: measured 1.00x the hand-written model under
``torch.compile`` on the small benchmark GPT, where one graph per block was 1.13x).  Under ZeRO 3 each repeated
block is an FSDP2 unit whose hooks gather and free its parameters around it, so there the compilation is
regional, as torch recommends for repeated layers: each block's ``forward`` is compiled once and serves every
block of its class (its parameters are graph inputs), the hooks run eagerly around it, and the module's own
``forward`` (embeddings, head, loss) is compiled around the blocks, its graph broken at each block call.
Regional compile time is one block's, not the model's.  Under ``--ep`` with ``--recompute`` the compilation is
regional too: torch's checkpoint under compile cannot hold the graph breaks at a block's expert exchanges, so
``rt.recompute`` runs it eagerly around each compiled block, which runs again, compiled, in backward.  Only ``forward``
is replaced (an instance attribute): the module, its parameter names, state dict and checkpoints are the eager ones, and
DDP's and FSDP2's hooks on the module stay outside the graph.

The collectives trace as functional collectives (:mod:`fxshard.runtime.collectives`), one graph node each.
The expert exchanges of ``--ep`` move as many rows as the routing sends: they run eagerly between compiled
graphs, a graph break at each (:mod:`fxshard.runtime.experts`).  ``rt.recompute`` traces as torch's checkpoint
operator, whose recompute the compiled backward does (:mod:`fxshard.runtime.recompute`).
On CPU the graphs' static fp32 matrix products of 4M multiply-adds and more run on oneDNN rather than torch's
MKL (``--cpu-matmul``, default ``onednn``: :mod:`fxshard.runtime.matmul` says why and which).  Inductor's CPU
code may reorder a reduction, and the two kernels sum a dot product in different orders; the losses of a compiled
run are tested against the eager run's within 1e-6 relative (``tests/runtime/test_compiled.py``).
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from fxshard.runtime import matmul

BACKEND = "inductor"


def compile_module(module: torch.nn.Module, regional: bool = False, cpu_matmul: str = "auto") -> torch.nn.Module:
    """Compile ``module``'s forward (a generated ``RankModule`` or pipeline stage) in place; return it.
    ``regional``: one graph per repeated block class, and the module's forward broken at the block calls.
    ``cpu_matmul``: the kernel of the graphs' fp32 CPU matrix products, one of
    :data:`fxshard.runtime.matmul.CPU_MATMULS`::

        compile_module(code.RankModule(groups, device))   # first call compiles, later calls reuse
    """
    options = inductor_options(cpu_matmul)
    for child in module.children() if regional else ():
        if type(child).__module__ == type(module).__module__:  # a repeated block of the same rank file
            child.forward = _region(child.forward, options)
    module.forward = torch.compile(module.forward, backend=BACKEND, options=options)
    return module


def _region(forward, options: dict):
    """``forward`` compiled on its own, and a graph break where the enclosing compiled forward calls it."""
    compiled = torch.compile(forward, backend=BACKEND, options=options)

    @torch.compiler.disable(recursive=False)  # this frame only: ``compiled`` below still compiles
    def block_forward(*args, **kwargs):
        return compiled(*args, **kwargs)

    return block_forward


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo, AOTAutograd and inductor, forward and
    backward), as torch's own counters record them."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return float(spent.get("total_wall_time", sum(spent.values())))


class OneDNNMatmuls(CustomGraphPass):
    """Inductor's post-grad pass of ``--cpu-matmul onednn``: :func:`fxshard.runtime.matmul.rewrite_products`."""

    def __init__(self, min_multiply_adds: int):
        self.min_multiply_adds = min_multiply_adds

    def __call__(self, graph: torch.fx.Graph) -> None:
        matmul.rewrite_products(graph, self.min_multiply_adds)

    def uuid(self) -> bytes:
        """Inductor's cache key for the graphs this pass rewrote: the rule's code and its threshold."""
        return get_hash_for_files((__file__, matmul.__file__)) + str(self.min_multiply_adds).encode()


def inductor_options(cpu_matmul: str) -> dict:
    """``torch.compile``'s inductor options for ``--cpu-matmul``: the pass above for ``onednn`` (where oneDNN is
    available; its threshold :data:`fxshard.runtime.matmul.MIN_MULTIPLY_ADDS` as it is now), none for ``torch``.

    >>> inductor_options("torch")
    {}
    """
    if cpu_matmul not in matmul.CPU_MATMULS:
        raise ValueError(f"cpu_matmul {cpu_matmul!r}: expected one of {', '.join(matmul.CPU_MATMULS)}")
    if matmul.chosen_kernel(cpu_matmul) == "onednn" and matmul.onednn_available():
        return {"post_grad_custom_post_pass": OneDNNMatmuls(matmul.MIN_MULTIPLY_ADDS)}
    return {}
