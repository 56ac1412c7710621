"""Activation recompute of one block: keep less of its forward for backward, and run that part again there.

Generated code wraps each repeated block's call when compiled with ``--recompute``::

    hidden = rt.recompute(self.model_layers_2, hidden, cos, sin, mask)                  # full
    hidden = rt.recompute(self.model_layers_2, hidden, cos, sin, mask, keep="matmuls")  # selective

``full`` keeps only the block's inputs and runs its whole forward again in backward (Megatron-LM's full
recompute); ``selective`` keeps what the block's matrix multiplies and fused attention kernels produce and
recomputes the cheap, memory-heavy rest (norms, activations, elementwise ops, softmax), in the spirit of
Korthikanti et al. 2022's selective recompute, through torch's selective activation checkpointing.  The
block's tensor-parallel collectives run again with the recomputed forward, on every tp rank alike.

Exact: the recomputed values are the ones the forward made.  Torch's random state is restored by
:func:`torch.utils.checkpoint.checkpoint`; fxshard's layout-invariant dropout masks are keyed by the batch and
microbatch being computed (:mod:`fxshard.runtime.random`), which a pipeline schedule has moved on from by
the time a block is recomputed, so the key of the forward is restored for the recompute.

Under ``torch.compile`` (``fxshard run --compile``) the checkpoint traces as torch's checkpoint higher-order op:
AOTAutograd's partitioner then decides what the compiled backward recomputes from the same policy (``full``:
every op of the block prefers recompute; ``selective``: :data:`SAVED_OPS` must be saved).  That path takes a
context function only as a module-level function or a ``functools.partial`` of one, so it has neither the
dropout key (``--compile`` refuses dropout: :func:`fxshard.train.options.check_compile`) nor the watchers of
:func:`watching_kept` (``--memory-report`` measures the eager run).  Around a block compiled on its own
(:func:`fxshard.train.modules.compiled_regionally`) dynamo cannot trace the checkpoint and runs it eagerly, with
the same arguments: the block runs again, compiled, in backward.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxshard.runtime import random as rt_random

aten = torch.ops.aten

KEEP = ("inputs", "matmuls")
KEEP_OF_MODE = {"full": "inputs", "selective": "matmuls"}  # --recompute mode -> what rt.recompute keeps
# what selective recompute keeps: the outputs of the ops that cost FLOPs (the linear layers' matrix
# multiplies, fused attention kernels, which hold no S x S matrix); everything else is recomputed
SAVED_OPS = {
    aten.mm.default, aten.addmm.default, aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default,
}


def recompute(block: torch.nn.Module, *args, keep: str = "inputs"):
    """``block(*args)``, keeping for backward only its inputs (``keep="inputs"``) or also its matmul outputs
    (``keep="matmuls"``), and recomputing the rest in backward with the same dropout masks."""
    if keep not in KEEP:
        raise ValueError(f"rt.recompute: keep={keep!r}; expected one of {', '.join(KEEP)}")
    if not torch.is_grad_enabled():
        return block(*args)
    if torch.compiler.is_compiling():
        return checkpoint(block, *args, use_reentrant=False, **_COMPILED_CONTEXT[keep])
    forward_key = copy.copy(rt_random._context)

    def contexts():
        if keep == "matmuls":
            first, again = create_selective_checkpoint_contexts(_policy)
        else:
            first, again = contextlib.nullcontext(), contextlib.nullcontext()
        return first, _Both(again, _keyed(forward_key))

    return checkpoint(block, *args, use_reentrant=False, context_fn=contexts)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective recompute's policy: save what :data:`SAVED_OPS` produce, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# rt.recompute's checkpoint arguments under torch.compile, by what it keeps (no context: recompute everything)
_COMPILED_CONTEXT = {"inputs": {},
                     "matmuls": {"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)}}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """:func:`_keep_matmuls`, telling the watchers of :func:`watching_kept` what it keeps in the forward."""
    if _keep_matmuls(ctx, op) is CheckpointPolicy.PREFER_RECOMPUTE:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        for note in _kept_watchers:
            for t in tree_leaves(ctx.op_output):
                if isinstance(t, torch.Tensor):
                    note(t)
    return CheckpointPolicy.MUST_SAVE


# callables told each output selective recompute keeps in its forward (torch's checkpoint caches these in its
# own storage, where saved_tensors_hooks do not see them): fxshard run --memory-report and fxshard plan count them
_kept_watchers: list = []


@contextlib.contextmanager
def watching_kept(note):
    """While entered, ``note(tensor)`` is called with every tensor a selective recompute keeps for backward::

        with watching_kept(kept.append):
            y = recompute(block, x, keep="matmuls")   # kept: the block's mm/addmm/attention outputs
    """
    _kept_watchers.append(note)
    try:
        yield
    finally:
        _kept_watchers.remove(note)


@contextlib.contextmanager
def _keyed(key):
    """Dropout keyed as in the forward being recomputed."""
    current = rt_random._context
    rt_random._context = copy.copy(key)
    try:
        yield
    finally:
        rt_random._context = current


class _Both(contextlib.ExitStack):
    """Two context managers entered together (checkpoint's ``context_fn`` returns one per pass)."""

    def __init__(self, *managers):
        super().__init__()
        self._managers = managers

    def __enter__(self):
        super().__enter__()
        for m in self._managers:
            self.enter_context(m)
        return self
