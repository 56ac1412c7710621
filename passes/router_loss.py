"""A mixture-of-experts load-balancing loss under ``--dp``: its two whole-batch means, over the whole batch.

With ``output_router_logits=True`` transformers' MoE models add ``coef * load_balancing_loss_func(...)`` to the
loss: E * sum_e f_e * P_e, f_e the fraction of the batch's (token, top-k) choices that went to expert e and P_e
the mean router probability of e.  transformers 5 computes both as a sum over every layer's rows divided by the
rows counted (``total_rows``)::

    tokens_per_expert = (histc(top-k ids of layer 0) + histc(... layer 1) + ...) / total_rows
    router_prob_per_expert = (softmax_0.sum(0) + softmax_1.sum(0) + ...) / total_rows

A dp rank holds its own rows only: its means are of its part, and the product of the means of the parts is not
the product of the whole batch's means (7.6e-4 relative on a tiny Mixtral at --dp 2).  This pass makes each
division a whole-batch mean, ``rt.batch_mean(sums, self.dp, rows=total_rows)``: the sums all-reduced over dp,
divided by every rank's rows.  P_e carries a gradient: one device gives each row 1 / (all rows); DDP averages the
ranks' gradients, so the backward gives dp / (all rows) (:func:`fxshard.runtime.collectives.batch_mean`).  Every
rank then holds the single-device loss term, and the gradients equal one device's.

What is not this shape is refused, naming what was found.  Pipeline microbatches and ``--grad-accum`` are refused
elsewhere (each microbatch or accumulated batch would need the means of batches not yet run).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.errors import LayoutError
from fxshard.ir.batch import COUNTS as _COUNTS
from fxshard.ir.batch import is_mean_of_sums
from fxshard.ir.batch import mean_terms as _terms
from fxshard.ir.context import DP, CompileContext, Group, NodeSpec, spec
from fxshard.ir.placement import Replicate
from fxshard.runtime import collectives as rtc

aten = torch.ops.aten


def router_loss_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    means = [n for n in gm.graph.nodes if is_mean_of_sums(n)]
    where = f"--dp {ctx.layout.dp}: {type(ctx.program.model).__name__}'s load-balancing loss"
    divisors = {n.args[1] for n in means}
    kinds = sorted({_term_kind(n) for n in means})
    if len(means) != 2 or len(divisors) != 1 or kinds != ["counts", "probabilities"]:
        raise LayoutError(f"{where}: expected two whole-batch means (top-k counts and router probabilities, sums over "
                          f"every layer's rows divided by the rows counted, as transformers 5 computes them); found "
                          f"{len(means)} such divisions ({', '.join(n.name for n in means) or 'none'}); set "
                          "output_router_logits=False in the model file, or train at --dp 1")
    rows = next(iter(divisors))
    probabilities = next(n for n in means if _term_kind(n) == "probabilities")
    counted = sum(t.args[0].meta["val"].shape[0] for t in _terms(probabilities.args[0]))
    if (rows != counted) if isinstance(rows, (int, float)) else not _is_mask_count(rows):
        raise LayoutError(f"{where}: expected {probabilities.name} to divide by the {counted} rows its sums add up "
                          f"(or by the attention mask's sum per layer); found {getattr(rows, 'name', rows)}; set "
                          "output_router_logits=False in the model file, or train at --dp 1")
    for node in means:
        with gm.graph.inserting_before(node):
            mean = gm.graph.call_function(rtc.batch_mean, (node.args[0], Group(DP)), {"rows": rows})
        mean.meta = {"val": node.meta["val"], "nn_module_stack": node.meta.get("nn_module_stack", {}),
                     "stack_trace": node.meta.get("stack_trace", ""),
                     "fxshard": NodeSpec(Replicate(), spec(node).fqn, "whole-batch mean", "batch_mean", None,
                                         spec(node).segment, spec(node).stage)}
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)
    ctx.notes.append(f"the load-balancing loss: its two whole-batch means ({kinds[0]} and {kinds[1]} per expert) "
                     f"are all-reduced over dp (rt.batch_mean): the loss and gradients of one device on the whole "
                     "batch")
    gm.recompile()
    return gm


def _term_kind(node: fx.Node) -> str:
    targets = {t.target for t in _terms(node.args[0])}
    return "counts" if targets <= _COUNTS else "probabilities" if targets == {aten.sum.dim_IntList} else "mixed"


def _is_mask_count(node) -> bool:
    """``0.0 + mask.sum() + mask.sum() + ...``: the rows the attention mask counts, once per layer."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.add.Tensor:
        a, b = node.args
        term, node = (b, a) if isinstance(b, fx.Node) and b.target is aten.sum.default else (a, b)
        if not (isinstance(term, fx.Node) and term.target is aten.sum.default):
            return False
        if not isinstance(node, fx.Node):
            return node == 0
    return False
