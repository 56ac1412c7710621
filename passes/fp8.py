"""FP8 linears: each eligible ``nn.Linear`` becomes ``rt.fp8_linear`` (``--fp8``, ``--dtype fp8``).

A dtype policy on linears, written where a reader sees it: every ``aten.linear`` of an ``nn.Linear`` that
:func:`fxshard.runtime.fp8.fp8_module` admits (not the output head, not a LoRA adapter, sizes multiples of 16) is
rewritten in place into a call that casts and scales its operands and multiplies in float8, torchao's recipe
(:mod:`fxshard.runtime.fp8`).  Where tp splits the weight the call is ``rt.fp8_linear_tp``, whose amaxes are
all-reduced with MAX over tp, forward and backward, so each scale is the whole tensor's (a collective kind of
:mod:`fxshard.ir.comm`)::

    linear_3 = rt.fp8_linear_tp(copy_to_2, self.tp, weight=self.fc_in_weight, bias=self.fc_in_bias,
                                recipe="tensorwise", split="out")
    linear_4 = rt.fp8_linear(gelu, self.proj_weight, None, recipe="tensorwise")

It runs after the collectives pass (the placements are final) and before the overlap pass, which fuses the
column-parallel ones reading an sp ``gather_to`` into ``rt.fp8_linears_regathered`` and leaves the others and their
``copy_to`` unfused.  A whole weight reading sequence parallelism's shard of the tokens (MLA's down-projections under
``--sp``) is ``split="rows"``: its amaxes over the tokens are all-reduced, each token's is its rank's own, and its
weight's ``copy_to`` sums the partial weight gradients as for a bf16 linear.  Refused, naming the module: a split
weight whose parts several ranks hold alike (key/value heads fewer than tp: each rank's gradient of such a part is
partial, so its amax is not the whole gradient's), and a linear whose input tp splits along its tokens as well as its
weight.  Under ``--cp`` every fp8 linear reads cp's share of the tokens, so each is ``rt.fp8_linear_tp`` over
``self.cp`` (``split="rows"`` where tp leaves the weight whole), or ``self.cp_tp`` with tp, tensorwise only
(fxshard.ir.layout refuses rowwise at cp and tp; :func:`amax_group`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.errors import ShardingError
from fxshard.ir.context import CP, CPTP, TP, CompileContext, Group, spec, update_spec
from fxshard.ir.placement import Shard
from fxshard.runtime import fp8 as rt_fp8

aten = torch.ops.aten


def fp8_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    recipe = ctx.layout.fp8_recipe
    modules = dict(ctx.program.model.named_modules())
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        fqn = spec(node).fqn
        module = modules.get(fqn)
        if module is None or not rt_fp8.fp8_module(fqn, module):
            continue
        x, weight, bias = (*node.args, None)[:3]
        split = _split(node, x, weight, fqn, ctx.layout.tp)
        if ctx.layout.cp > 1:  # every linear reads cp's share of the tokens: a tensorwise amax spans cp too
            split = split or "rows"
        if split is None:
            node.target, node.args = rt_fp8.fp8_linear, (x, weight, bias)
        else:
            # weight and bias by keyword: a collective kind's fake and the checks' recorder read them so
            node.target, node.args = rt_fp8.fp8_linear_tp, (x, amax_group(ctx.layout))
            node.kwargs = {"weight": weight, "bias": bias, "recipe": recipe, "split": split}
            update_spec(node, collective="fp8_linear_tp")
            continue
        node.kwargs = {"recipe": recipe}
    gm.recompile()
    return gm


def amax_group(layout) -> Group:
    """The group an fp8 linear's amaxes are all-reduced over: tp; under ``--cp`` its tokens are split over cp as
    well, so cp (``cp_tp`` with tp: the weight's amaxes are the same on every cp rank, the tokens' the same on every
    tp rank a column-parallel linear's input is whole on, so one MAX over both is each tensor's whole amax)."""
    if layout.cp > 1:
        return Group(CPTP) if layout.tp > 1 else Group(CP)
    return Group(TP)


def _split(node: fx.Node, x: fx.Node, weight: fx.Node, fqn: str, tp: int) -> str | None:
    """Which dimension of the weight tp splits: ``"out"`` (column-parallel), ``"in"`` (row-parallel), None."""
    w, xp = spec(weight).placement, spec(x).placement
    if tp == 1 or not isinstance(w, Shard):
        if isinstance(xp, Shard) and tp > 1:  # the weight whole, its input's tokens split: sp's shard (MLA's q_a_proj)
            rank = len(x.meta["val"].shape)
            if xp.general or xp.blocks > 1 or xp.dim % rank == rank - 1:
                raise ShardingError(f"{fqn}: an fp8 linear whose input is split over tp as {xp} and whose weight is "
                                    "whole: its scales would need amaxes fxshard does not gather; replicate its input "
                                    "in the plan, or train without --fp8")
            return "rows"
        return None
    if w.general:
        raise ShardingError(f"{fqn}: fp8 on a weight whose parts several tp ranks hold alike ({w}): each rank's "
                            "gradient of such a part is partial, so its amax is not the whole gradient's; use a tp "
                            "that divides the key/value heads, or train without --fp8")
    if isinstance(xp, Shard) and xp.dim % len(x.meta["val"].shape) != len(x.meta["val"].shape) - 1:
        raise ShardingError(f"{fqn}: an fp8 linear whose input is split along dimension {xp.dim} over tp (its tokens) "
                            "as well as its weight; replicate this module in the plan, or train without --fp8")
    return "out" if w.dim % 2 == 0 else "in"  # weight [out, in]: dim 0 (-2) out, dim 1 (-1) in
