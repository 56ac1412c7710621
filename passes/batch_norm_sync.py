"""Batch normalization in training mode when the batch is split: its statistics over the whole batch.

``nn.BatchNorm*d`` in training normalizes by the mean and variance of the whole batch, so each example's output
depends on every other example.  A dp rank holds its own rows: its statistics are of its part, and a ResNet-style
classifier trained at dp=2 was 0.41 off one device.  Under ``--dp`` this pass gives each such op SyncBatchNorm's
semantics, in three lines of the rank file (:mod:`fxshard.runtime.batch_norm`)::

    batch_stats = rt.batch_stats(x)                              # [2, C]: this rank's mean and variance
    gather_to = rt.gather_to(batch_stats, self.dp, dim=0)        # [2 * dp, C]: every rank's
    batch_norm = rt.batch_norm_from_stats(x, gather_to, weight, bias, running_mean, running_var, 0.1, 1e-05)

Backward flows through the gathered statistics: ``gather_to``'s reduce-scatter gives each rank the sum of every
rank's gradient of its statistics, which the data-parallel average of the weights' gradients makes one device's.

Pipeline microbatches cannot be made exact: a schedule runs microbatch 0 through a stage before the rest of the
batch exists, so such a compile is refused, naming each op and its module; ``--grad-accum`` is refused at launch for
the same reason (the manifest lists the ops, :attr:`CompileContext.batch_couplings`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from fxshard.errors import LayoutError
from fxshard.graph import ancestors, node_fqn
from fxshard.ir.batch import refuse_microbatches
from fxshard.ir.context import DP, CompileContext, Group, spec
from fxshard.ir.placement import Replicate, Shard
from fxshard.ir.sharding import argument, tensor_args
from fxshard.runtime import batch_norm as rt_bn
from fxshard.runtime import collectives as rtc

aten = torch.ops.aten
# the training-mode form torch.export records for nn.BatchNorm*d and F.batch_norm; the others are refused under a split
_SYNCED = aten.batch_norm.default
_OTHERS = {aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
           aten._native_batch_norm_legit_functional.default, aten._batch_norm_with_update.default}


def batch_norm_sync_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    norms = [n for n in gm.graph.nodes if n.op == "call_function" and _is_training_norm(n, ctx.user_inputs)]
    if not norms:
        return gm
    model = type(ctx.program.model).__name__
    found = [f"{node_fqn(n) or model}: {n.target} (batch statistics)" for n in norms]
    ctx.batch_couplings = [*ctx.batch_couplings, *found]  # as batch_gather_pass: each pass adds its own
    listed = "; ".join(found)
    refuse_microbatches(ctx, listed, "normalizes by the statistics of the whole batch")
    if ctx.layout.dp == 1:
        return gm
    for n in norms:
        if n.target is not _SYNCED:
            raise LayoutError(f"--dp {ctx.layout.dp}: {node_fqn(n) or model}: {n.target} normalizes by the whole "
                              "batch's statistics, and fxshard synchronizes only aten.batch_norm (nn.BatchNorm*d, "
                              "F.batch_norm); train at --dp 1")
        _sync(gm, n, ctx.layout.dp)
    ctx.notes.append(f"--dp {ctx.layout.dp}: {listed}: the statistics of each dp rank's rows gathered over dp and "
                     "combined (SyncBatchNorm's semantics): the outputs and gradients of one device on the whole batch")
    gm.recompile()
    return gm


def _is_training_norm(node: fx.Node, user_inputs: set[fx.Node]) -> bool:
    """A batch normalization in training mode of a value computed from the batch."""
    if node.target is _SYNCED:
        training = argument(node, "training", True)
    elif node.target in _OTHERS:
        training = node.target is not aten._native_batch_norm_legit.default or argument(node, "training", True)
    else:
        return False
    return bool(training) and _reads(node.args[0], user_inputs)


def _reads(node, user_inputs: set[fx.Node]) -> bool:
    return isinstance(node, fx.Node) and any(n in user_inputs for n in ancestors([node]))


def _sync(gm: fx.GraphModule, node: fx.Node, dp: int) -> None:
    """``batch_norm(x, w, b, rm, rv, training, momentum, eps, cudnn)`` -> statistics of this rank's rows, gathered
    over dp and combined (:mod:`fxshard.runtime.batch_norm`)."""
    x, w, b, rm, rv = (argument(node, k) for k in ("input", "weight", "bias", "running_mean", "running_var"))
    momentum, eps = argument(node, "momentum"), argument(node, "eps")
    fqn = node_fqn(node) or "the model"
    if not isinstance(momentum, float):
        raise LayoutError(f"{fqn}: batch normalization with momentum={momentum!r} (a cumulative average) under "
                          "--dp: fxshard synchronizes a float momentum; set one or train at --dp 1")
    placement = spec(node).placement
    if placement not in (Replicate(), Shard(1)):
        raise LayoutError(f"{fqn}: batch normalization of a value split over tp as {placement}: fxshard synchronizes "
                          "it over dp when it is whole on each tp rank or split by channel (S(1))")
    val = x.meta["val"]
    with gm.graph.inserting_before(node):
        stats = gm.graph.call_function(rt_bn.batch_stats, (x,))
        gathered = gm.graph.call_function(rtc.gather_to, (stats, Group(DP)), {"dim": 0})
        synced = gm.graph.call_function(rt_bn.batch_norm_from_stats, (x, gathered, w, b, rm, rv, momentum, eps))
    local = val.new_empty((2, val.shape[1]))
    base = spec(node)
    for new, v, collective in ((stats, local, ""), (gathered, local.new_empty((2 * dp, val.shape[1])),
                                                    "gather_to"), (synced, node.meta["val"], "")):
        new.meta = {"val": v, "nn_module_stack": node.meta.get("nn_module_stack", {}),
                    "stack_trace": node.meta.get("stack_trace", "")}
        # the inputs as they are (the batch norm's were placed): the statistics are split by channel as x is
        inputs = None if collective else tuple(spec(a).placement if a is not stats and a is not gathered
                                               else placement for a in tensor_args(new))
        new.meta["fxshard"] = dataclasses.replace(base, collective=collective, inputs=inputs,
                                                  role="synchronized batch norm")
    node.replace_all_uses_with(synced)
    gm.graph.erase_node(node)


def has_batch_norm(gm: fx.GraphModule) -> bool:
    """Whether the program normalizes by batch statistics (the registry's gate: the pass runs at every layout where it
    does; at --dp 1 it records the ops, which --grad-accum refuses, and rewrites nothing)."""
    return any(n.op == "call_function" and (n.target is _SYNCED or n.target in _OTHERS) for n in gm.graph.nodes)
