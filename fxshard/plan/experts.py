"""Tensor parallelism inside mixture-of-experts experts (``moe_tp_experts``, Megatron-Core's expert tensor
parallelism): each tp rank holds 1/tp of every expert's intermediate size.

An experts module the plan styles :func:`fxshard.plan.styles.moe_tp_experts` runs as two grouped matmuls
(:mod:`fxshard.ir.experts`).  Its weights get placements, and propagation does the rest as it does for a
column-parallel / row-parallel Linear pair::

    gate_up_proj [E, 2I, H]  S(1)x2   each rank: the gate's and the up half's I/tp columns of every expert
    down_proj    [E, H, I]   S(2)     each rank: the same I/tp rows of every expert's down projection
    tokens [T, H] R --copy_to--> rows [M, H] R --> grouped_mm --> [M, 2I/tp] S(1)x2 --chunk--> gate, up S(1)
        --act, mul--> S(1) --> grouped_mm --> [M, H] P(sum) --combine--> [T, H] P(sum) --all_reduce--> R

The combine (each row times its routing weight, the rows back in token order, each token's top-k rows summed:
:func:`fxshard.ir.experts.combine_chain`) is linear in the rows, so the partial sums pass through it and are
reduced once per layer on the ``[T, H]`` tokens rather than on the ``[M, H] = [T*k, H]`` rows (Megatron-Core
reduces after its unpermute too): k times fewer bytes.  The routing weights get a ``copy_to``: each rank's
gradient for them comes from its own partial sums, and its backward sums them over tp.  Only the nodes of
this pattern pass partial sums through a product; no other model's reductions move.

In backward the same holds the other way: the dispatch (the tokens' rows gathered in expert order:
:func:`fxshard.ir.experts.dispatch_chain`) is linear, so the ``copy_to`` whose backward sums the rows' gradient
over tp sits on the ``[T, H]`` tokens before it (``NodeSpec.enters``), not on the ``[M, H]`` rows: one ``[T, H]``
all-reduce per layer in backward too (under ``--sp`` a ``gather_to``: reduce-scatter of the ``[T, H]`` gradient).

The split sizes come from the grouped matmuls' weight arguments traced back to the parameters (through the
model's transposes), so transformers' own entries for the weights (``packed_colwise``, ``rowwise``) are not
needed.  Every rank routes the same rows (the router is replicated), so the result is the one-device result
up to the order of the all-reduce's sum.  What does not fit this pattern exactly is refused naming the module:
an error where the user's plan asked for it; a note, with the experts kept whole, where only the model's own
plan did.  An intermediate size tp does not divide is an error either way, as a Linear's split size is: the
pattern fits, the layout does not, and the message names the tp values that divide it and how to keep the
experts whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.fx as fx

from fxshard.errors import PlanError, ShardingError, divisors
from fxshard.graph import node_fqn
from fxshard.ir.context import CompileContext
from fxshard.ir.experts import (
    combine_chain,
    dispatch_chain,
    grouped_mms,
    not_row_wise,
    offsets,
    param_dim,
    weight_param,
)
from fxshard.ir.placement import Partial, Placement, Shard
from fxshard.ir.sharding import Propagation, shape


@dataclass
class ExpertSplit:
    """The expert weights' placements over tp, and the grouped matmul pairs they split (checked after propagation)."""

    weights: dict[fx.Node, Placement] = field(default_factory=dict)
    layers: list[tuple[str, fx.Node, fx.Node, int]] = field(default_factory=list)  # fqn, first, second, blocks
    combine: set[fx.Node] = field(default_factory=set)  # the combines' nodes: partial sums pass through them
    dispatch: set[fx.Node] = field(default_factory=set)  # the dispatches' nodes: tp begins before them

    def check(self, prop: Propagation) -> None:
        """Each split layer computes as planned: split columns out of the first grouped matmul, partial sums out
        of the second, nothing between them gathered."""
        for fqn, first, second, blocks in self.layers:
            got = (prop.decisions[first].out, prop.decisions[second].out)
            gathered = [n.name for n in prop.fallbacks if node_fqn(n) == fqn]
            if got != (Shard(1, blocks), Partial()) or gathered:
                raise ShardingError(
                    f"{fqn}: moe_tp_experts expected the first grouped matmul {first.name} to give split columns "
                    f"({Shard(1, blocks)}) and the second {second.name} partial sums (P(sum)); found {got[0]} and "
                    f"{got[1]}{f', with {gathered} gathered between them' if gathered else ''}. "
                    f"{_keep_whole(fqn)}")


def expert_split(gm: fx.GraphModule, ctx: CompileContext) -> ExpertSplit:
    """Placements for the experts modules ``ctx.plan`` styles ``moe_tp_experts``::

        split = expert_split(gm, ctx)   # split.weights: {gate_up_proj: Shard(1, blocks=2), down_proj: Shard(2)}
    """
    plan, tp, ep = ctx.plan, ctx.layout.tp, ctx.layout.ep
    wanted = sorted(fqn for fqn, s in plan.styles.items() if s.kind == "experts")
    split = ExpertSplit()
    if not wanted or tp == 1:
        return split
    if ep > 1:
        asked = [fqn for fqn in wanted if plan.sources.get(fqn) != "model"]
        if asked:
            raise PlanError(
                f"{asked[0]}: the {plan.sources[asked[0]]} plan splits the experts over tp (moe_tp_experts) and "
                f"--ep {ep} splits them over ep; both at once (expert tensor parallelism inside expert parallelism) "
                "is not supported yet: drop --ep, or drop the moe_tp_experts entry (the experts then stay whole on "
                "each tp rank of their ep rank)")
        ctx.notes.append(f"{_glob(wanted[0])} (moe_tp_experts in the model's plan): under --ep {ep} the experts are "
                         "split over ep and stay whole on every tp rank (tensor parallelism inside expert-parallel "
                         "experts is not supported yet)")
        return split
    layers = grouped_mms(gm, node_fqn)
    for fqn in wanted:
        _split_layer(fqn, layers.get(fqn, []), ctx, split)
    return split


def _split_layer(fqn: str, mms: list[fx.Node], ctx: CompileContext, split: ExpertSplit) -> None:
    state, tp = ctx.program.state_by_name(), ctx.layout.tp
    user = ctx.plan.sources.get(fqn) != "model"

    def decline(why: str) -> None:
        if user:
            raise PlanError(f"{fqn}: moe_tp_experts {why}. {_keep_whole(fqn)}")
        note = f"{_glob(fqn)} (moe_tp_experts in the model's plan): {why}; the experts stay whole on every tp rank"
        if note not in ctx.notes:
            ctx.notes.append(note)

    if len(mms) != 2:
        return decline(f"expected two grouped matmuls (gate/up, then down: transformers 5 experts with "
                       f"experts_implementation='grouped_mm'), found {len(mms)}")
    first, second = mms
    if offsets(second) is not offsets(first):
        return decline(f"expected both grouped matmuls to take the same expert offsets; found "
                       f"{offsets(first).name} and {offsets(second).name}")
    why = not_row_wise(first, second)
    if why is not None:
        return decline(f"cannot split each row's columns exactly: {why}")
    (up, up_chain), (down, down_chain) = (weight_param(mm.args[1], ctx.params) for mm in mms)
    if up is None or down is None or len(shape(first.args[1])) != 3 or len(shape(second.args[1])) != 3:
        return decline("expected each grouped matmul's weight to be a stacked [E, in, out] expert parameter "
                       "(transposed or cast at most)")
    names = {state[up.name].fqn, state[down.name].fqn}
    extra = sorted(s.fqn for s in ctx.program.state if s.kind == "parameter" and s.fqn.startswith(fqn + ".")
                   and s.fqn not in names)
    if extra:
        return decline(f"splits the two stacked weights its grouped matmuls read ({', '.join(sorted(names))}); "
                       f"found more parameters beside them ({', '.join(extra)}: a bias?), which it does not split")
    columns, inner = shape(first)[-1], shape(second.args[0])[-1]  # 2I (gate and up packed) or I, and I
    if columns not in (inner, 2 * inner):
        return decline(f"expected the first grouped matmul's {columns} columns to be the second's {inner} "
                       "contracted ones (or twice that: gate and up packed)")
    if inner % tp:
        ok = ", ".join(map(str, divisors(inner)))
        raise ShardingError(f"{fqn}: moe_tp_experts splits each expert's intermediate size {inner} over tp={tp}, "
                            f"which {tp} does not divide; use tp in {{{ok}}}, or {_keep_whole(fqn, lower=True)}")
    blocks = columns // inner
    split.weights[up] = Shard(param_dim(up_chain, 2), blocks)
    split.weights[down] = Shard(param_dim(down_chain, 1))
    split.layers.append((fqn, first, second, blocks))
    split.combine.update(combine_chain(second, node_fqn))
    split.dispatch.update(dispatch_chain(first, node_fqn))


def _glob(fqn: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.*.mlp.experts``: the plan key for every layer's experts."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


def _keep_whole(fqn: str, lower: bool = False) -> str:
    text = (f"Keep the experts whole on every tp rank with the plan entry {{{_glob(fqn)!r}: fxshard.replicate()}} "
            "(or split them over data-parallel ranks with --ep)")
    return text[0].lower() + text[1:] if lower else text
