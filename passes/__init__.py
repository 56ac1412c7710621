"""The pass registry: which passes a compile runs, in which order, what each relies on and leaves true, and when.

One :class:`~fxshard.ir.contracts.Pass` entry per pass: its function, the facts it ``requires`` and ``ensures``
(:mod:`fxshard.ir.contracts`), and its gates: ``layout_gate`` (the layout asks for it: ``--cp``, ``--ep``, overlap)
and ``program_gate`` (the program holds what it acts on: a masked attention, a batch norm, a router loss).  The
compiler (:func:`fxshard.compiler.run_passes`) reads this list and nothing else of the passes: it refuses an order
that leaves a requirement unmet before any pass runs, skips an entry whose gate says no (that pass is then not
named in the rank files' headers), lints the graph after each pass and checks what it and the passes before it
ensured::

    >>> from fxshard.passes import PASSES, registered
    >>> [p.name for p in PASSES][:4]
    ['token_mean', 'causal_attention', 'context_parallel', 'tensor_parallel']
    >>> [fact.name.split(":")[0] for fact in registered("tensor_parallel").requires]
    ['token means made whole-step', 'causal masks proven', 'the sequence split over cp']

Order is data, never a comment: a pass that must run before another ensures a fact the other requires (the
token means, the causal masks and the cp split all change the global program the tensor-parallel pass places).
This module is the only importer of the pass modules (``tests/test_layers.py`` holds every other module to it):
what a pass shares with other code lives in ``fxshard/ir`` or ``fxshard/graph.py``.
"""

from __future__ import annotations

from fxshard.passes.batch_gather import batch_gather_pass
from fxshard.passes.batch_norm_sync import batch_norm_sync_pass, has_batch_norm
from fxshard.passes.batch_rows import batch_rows_pass
from fxshard.passes.blocks import blocks_pass
from fxshard.passes.causal_attention import causal_attention_pass, has_masked_attention
from fxshard.passes.checks import checks_pass
from fxshard.passes.collectives import collectives_pass
from fxshard.passes.context_parallel import context_parallel_pass
from fxshard.passes.dropout import dropout_pass
from fxshard.passes.expert_parallel import expert_parallel_pass
from fxshard.passes.fp8 import fp8_pass
from fxshard.passes.overlap import overlap_pass
from fxshard.passes.pipeline import pipeline_pass
from fxshard.passes.router_loss import router_loss_pass
from fxshard.passes.saved_activations import saved_activations_pass
from fxshard.passes.tensor_parallel import tensor_parallel_pass
from fxshard.passes.token_mean import token_mean_pass

from fxshard.ir.batch import cross_batch_products, has_router_loss
from fxshard.ir.contracts import (
    BLOCKED,
    CAUSAL_MASKS,
    COMMUNICATED,
    MASKS_INVARIANT,
    OVERLAPPED,
    PLACED,
    ROWS_WHOLE,
    SEQUENCE_SPLIT,
    STAGED,
    TOKEN_MEANS,
    Pass,
)

PASSES: tuple[Pass, ...] = (
    # before the placements are decided: each changes the global program the tensor-parallel pass places
    Pass(token_mean_pass, ensures=(TOKEN_MEANS,)),
    Pass(causal_attention_pass, ensures=(CAUSAL_MASKS,),
         program_gate=lambda ctx: has_masked_attention(ctx.program.gm)),  # named in headers only where it can act
    Pass(context_parallel_pass, requires=(TOKEN_MEANS, CAUSAL_MASKS), ensures=(SEQUENCE_SPLIT,),
         layout_gate=lambda layout: layout.cp > 1),
    Pass(tensor_parallel_pass, requires=(TOKEN_MEANS, CAUSAL_MASKS, SEQUENCE_SPLIT), ensures=(PLACED,)),
    Pass(collectives_pass, requires=(PLACED,), ensures=(COMMUNICATED,)),
    # --fp8 / --dtype fp8: the eligible linears' products in float8, scales over tp where tp splits a weight; before
    # overlap, which fuses aten.linear alone
    Pass(fp8_pass, requires=(COMMUNICATED,), layout_gate=lambda layout: layout.fp8_recipe is not None),
    Pass(expert_parallel_pass, requires=(COMMUNICATED,), layout_gate=lambda layout: layout.ep > 1),
    # under --dp, where the model adds transformers' load-balancing loss: its two means made whole-batch means
    Pass(router_loss_pass, requires=(COMMUNICATED,), layout_gate=lambda layout: layout.dp > 1,
         program_gate=lambda ctx: has_router_loss(ctx.program.model)),
    # at every layout where the program holds one: at --dp 1 they record the ops (--grad-accum and pipeline
    # microbatches refuse them) and rewrite nothing
    Pass(batch_norm_sync_pass, requires=(COMMUNICATED,), program_gate=lambda ctx: has_batch_norm(ctx.program.gm)),
    Pass(batch_gather_pass, requires=(COMMUNICATED,),
         program_gate=lambda ctx: bool(cross_batch_products(ctx.program.gm, ctx.user_inputs, ctx.rows))),
    # where the batch is split (dp, microbatches) and the batch-row analysis (fxshard.ir.rows, run by the compiler)
    # found values that need the whole batch: computed whole under --dp, refused with microbatches
    Pass(batch_rows_pass, requires=(COMMUNICATED,), ensures=(ROWS_WHOLE,),
         program_gate=lambda ctx: ctx.rows is not None and ctx.rows.acts),
    # reads the final placements, and which values are computed on the whole batch (their draws' rows)
    Pass(dropout_pass, requires=(COMMUNICATED, ROWS_WHOLE), ensures=(MASKS_INVARIANT,)),
    # local ops keeping less for backward (same values); before the cut, which sizes stages by the ops
    Pass(saved_activations_pass, requires=(COMMUNICATED,)),
    Pass(pipeline_pass, requires=(PLACED, COMMUNICATED), ensures=(STAGED,)),
    Pass(blocks_pass, requires=(COMMUNICATED, STAGED), ensures=(BLOCKED,)),
    # --no-overlap keeps copy_to and the linears; zero-bubble's split backward would run the fused backward twice
    Pass(overlap_pass, requires=(COMMUNICATED, STAGED, BLOCKED), ensures=(OVERLAPPED,),
         layout_gate=lambda layout: layout.overlap and layout.schedule != "zero-bubble"),
    Pass(checks_pass, requires=(PLACED, COMMUNICATED)),
)


def registered(name: str) -> Pass:
    """The registry's entry for the pass ``name`` (``"tensor_parallel"``), for the tests that stand in for one."""
    found = [p for p in PASSES if p.name == name]
    if not found:
        raise KeyError(f"no pass {name!r} in fxshard.passes.PASSES; the passes are {[p.name for p in PASSES]}")
    return found[0]
