"""Make a token-mean loss a mean over the whole step's counted tokens, under any layout.

``F.cross_entropy(logits, target, ignore_index=-100)`` (and ``nll_loss``; Hugging Face's ForCausalLMLoss and
ForMaskedLMLoss without ``num_items_in_batch`` call it) divides the summed token losses by the number of
targets that are not ``ignore_index``.  A microbatch, a dp rank's rows or one of several accumulated batches
counts its own tokens, so a mean of their means weights a token by how crowded its part of the batch was:
a right-padded batch trained at dp=2 or pp=2 differed from one device by 5e-4 at step 1.

This pass makes the loss a *sum* over counted tokens and divides it by ``rt.token_mean``'s divisor, which the
runtime sets before every step from the count of the whole step (every microbatch, dp rank and accumulated
batch: the batch is on every rank, so no communication is needed).  The count comes from the program itself:
the graph that computes the loss's targets from the inputs is emitted as ``count_tokens`` in each rank file.
With the divisor N / D (N counted tokens, D = microbatches · dp · accumulated batches, the factor by which
training averages gradients and losses), every layout trains exactly as one device on the whole step.

A loss adding several such means (masked LM plus sentence order; extractive QA's start and end losses, whose
ignore index is the sequence length) is rewritten term by term: ``rt.token_mean(..., term=k)`` divides each by its
own count over the step, and ``count_tokens`` returns the counts of all terms (a vector).  Plain means with the
same number of values in every part of the batch, and terms the batch does not enter, stay as they are; a mean
over the values a boolean mask of the batch selects (ELECTRA's discriminator loss, ``loss[mask].mean()``) is a sum
over the count of the mask's true elements.

Which terms are such means, and the graph that counts their targets, is :mod:`fxshard.ir.token_means` (the
single-device reference counts with it too).  A loss this pass cannot prove a token mean (class weights, a loss
computed further from the cross entropy) keeps the averaging, with a note when the layout splits the batch.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.graph import node_fqn
from fxshard.ir.batch import cross_batch_products, whole_batch_region
from fxshard.ir.context import CompileContext, NodeSpec
from fxshard.ir.token_means import ELEMENT_LOSSES, LOSSES, MEAN, PLAIN_MEANS, SUM, count_graph, counted_terms
from fxshard.runtime import loss as rt_loss

aten = torch.ops.aten


def token_mean_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0][0]
    whole = whole_batch_region(cross_batch_products(gm, ctx.user_inputs, ctx.rows))
    if ctx.rows is not None:  # values passes/batch_rows.py computes on the whole batch: a loss there is as it is
        names = set(ctx.rows.whole)
        whole |= {n for n in gm.graph.nodes if n.name in names}
    terms = counted_terms(loss, ctx.user_inputs, whole)
    if not terms:
        if (ctx.layout.dp > 1 or ctx.layout.pp > 1) and loss not in whole:
            ctx.notes.append(f"the loss ({getattr(loss, 'target', loss)}) is not a token mean fxshard can prove: it "
                             "is averaged over microbatches and dp ranks, which equals single-device training only "
                             "when each part weighs its rows the same")
        return gm
    several = len(terms) > 1
    for k, (node, target, ignore_index) in enumerate(terms):
        if node.target in LOSSES:
            _as_token_mean(gm, node, target, ignore_index, k if several else None)
        else:
            _as_masked_mean(gm, node, target, k if several else None)
    ctx.token_count = count_graph(gm, ctx.user_inputs, [(t, i) for _, t, i in terms])
    if several:
        ctx.notes.append(f"the loss: {len(terms)} means over counted targets ("
                         + ", ".join(f"{node_fqn(n) or n.name} counting {_counted(n, i)}" for n, _, i in terms)
                         + "), each generated as a sum divided by its own count over the step (count_tokens in each "
                         "rank file): every layout and --grad-accum weighs each by its own global count, as one device")
    else:
        node, _, ignore_index = terms[0]
        ctx.notes.append(f"{node_fqn(node) or 'the loss'}: a token mean ({_counted(node, ignore_index)} counted), "
                         "generated as a sum divided by the step's count (count_tokens in each rank file): every "
                         "layout and --grad-accum trains as one device on the whole step")
    gm.recompile()
    return gm


def _counted(loss: fx.Node, ignore_index: int) -> str:
    return f"targets other than {ignore_index}" if loss.target in LOSSES else "the values a mask of the batch selects"


def _as_token_mean(gm: fx.GraphModule, loss: fx.Node, target: fx.Node, ignore_index: int, term: int | None) -> None:
    """``loss`` (a mean over counted targets) as a sum over them, divided by ``rt.token_mean``'s divisor."""
    args = list(loss.args) + [None, MEAN, ignore_index][len(loss.args) - 2:] if len(loss.args) < 5 else list(loss.args)
    args[2] = loss.kwargs.get("weight", args[2])
    args[3] = SUM
    args[4] = ignore_index
    loss.args = tuple(args)
    loss.kwargs = {k: v for k, v in loss.kwargs.items() if k not in ("weight", "reduction", "ignore_index")}
    kwargs = {"ignore_index": ignore_index} | ({"term": term} if term is not None else {})
    with gm.graph.inserting_after(loss):
        mean = gm.graph.call_function(rt_loss.token_mean, (loss, target), kwargs)
    mean.meta = {"val": loss.meta["val"], "nn_module_stack": loss.meta.get("nn_module_stack", {}),
                 "fxshard": NodeSpec(fqn=node_fqn(loss), role="token mean")}
    loss.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)  # the returned .loss too


def _as_masked_mean(gm: fx.GraphModule, loss: fx.Node, mask: fx.Node, term: int | None) -> None:
    """``loss`` (a mean over the values a boolean ``mask`` selects) as their sum over ``rt.token_mean``'s divisor,
    which counts the mask's true elements (ignore index 0: ``mask != 0``)."""
    if loss.target in PLAIN_MEANS:
        loss.target, loss.args, loss.kwargs = aten.sum.default, loss.args[:1], {}
    else:
        at = ELEMENT_LOSSES[loss.target]
        args = list(loss.args) + [None] * (at + 1 - len(loss.args))
        args[at] = SUM
        loss.args = tuple(args)
        loss.kwargs = {k: v for k, v in loss.kwargs.items() if k != "reduction"}
    kwargs = {"ignore_index": 0} | ({"term": term} if term is not None else {})
    with gm.graph.inserting_after(loss):
        mean = gm.graph.call_function(rt_loss.token_mean, (loss, mask), kwargs)
    mean.meta = {"val": loss.meta["val"], "nn_module_stack": loss.meta.get("nn_module_stack", {}),
                 "fxshard": NodeSpec(fqn=node_fqn(loss), role="token mean")}
    loss.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
