"""Split weights column/row-wise over the ``tp`` axis and rewrite the graph to per-rank sizes.

Reads the resolved plan (``ctx.plan``), gives each weight its placement, propagates placements
through every op (``fxshard.ir.sharding``), then makes the graph compute one rank's part:

* shape constants baked in by export (``view``/``reshape``/``expand`` sizes, ``split`` sizes) become
  per-rank values — e.g. ``view(q, [2, 8, 4, 16])`` becomes ``[2, 8, 2, 16]`` at tp=2;
* a row-parallel bias is taken out of the matmul and added once, after the reduction;
* a vocabulary-parallel embedding becomes a masked lookup of this rank's rows;
* a cross entropy over logits split by class (a column-parallel LM head) becomes Megatron's
  vocab-parallel cross entropy: each rank reduces its classes to a logsumexp and the target's logit
  per token, and only those are gathered, never the logits.

Every split size is checked: a size the tp degree does not divide is a :class:`ShardingError`
naming the module and the degrees that would work.  Inserting the communication is the next
pass's job (``passes/collectives.py``); this pass records required input placements for it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from fxshard.errors import PlanError, ShardingError, divisors
from fxshard.graph import node_fqn
from fxshard.ir.context import TP, CompileContext, NodeSpec, RankValue, spec, update_spec
from fxshard.ir.localize import SIZED, localize_sizes
from fxshard.ir.placement import Placement, Replicate, Shard
from fxshard.ir.sharding import (
    Propagation,
    argument,
    propagate,
    shape,
    tensor_args,
    vocab_parallel_loss,
    written_inputs,
)
from fxshard.plan.auto import auto_plan, complete_plan
from fxshard.plan.demand import demanded_placements
from fxshard.plan.experts import expert_split
from fxshard.plan.layers import WeightOp, style_placements, weight_ops
from fxshard.plan.lora import lora_layers, plan_lora
from fxshard.plan.styles import ResolvedPlan
from fxshard.plan.unsplit import unsplit_parameters
from fxshard.runtime import tensor_parallel as rt_tp

aten = torch.ops.aten

_DEMAND_ROUNDS = 4  # a parameter read through another's split (Mamba-1's dt_proj bias after its weight) waits a round
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "n_kv_heads",
               "num_kv_heads")


def tensor_parallel_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    tp = ctx.layout.tp
    _refuse_parameter_writes(gm, ctx)
    ops = weight_ops(gm, ctx.params)
    given = ResolvedPlan(source="none (tp=1)") if tp == 1 else ctx.plan  # at tp=1 nothing is split
    ctx.plan, weights, forced, roles = _plan_placements(gm, ops, ctx, given, tp, ctx.notes)
    experts = expert_split(gm, ctx)
    weights |= experts.weights
    roles |= {fqn: "expert tensor-parallel" for fqn, *_ in experts.layers}
    prop = propagate(gm, weights, forced, sequence=tp if ctx.layout.sp else None, linear=experts.combine)
    for _ in range(_DEMAND_ROUNDS) if tp > 1 else ():  # bare parameters the split computation asks for
        asked = demanded_placements(gm, prop, weights, ctx.params, tp)
        if not asked:
            break
        weights |= asked
        prop = propagate(gm, weights, forced, sequence=tp if ctx.layout.sp else None, linear=experts.combine)
    if ctx.layout.sp and not prop.sequence:
        ctx.notes.append("--sp: no value is split over tokens (no row-parallel or vocab-parallel partial sum of "
                         "[.., S, H] tokens that a token-wise op reads): the layout runs as without --sp")
    _check_divisible(gm, prop, tp, ctx, ops, experts.weights, given)
    experts.check(prop)
    apply_propagation(gm, prop, ctx, roles)
    for node in experts.dispatch:
        update_spec(node, enters=True)
    ctx.unsplit = unsplit_parameters(gm, ctx, ops)
    if ctx.unsplit.warns:
        ctx.notes.append(ctx.unsplit.note())
    return gm


def _planned(gm: fx.GraphModule, ops: list[WeightOp], params: set[fx.Node], user_inputs: set[fx.Node],
             given: ResolvedPlan, tp: int) -> ResolvedPlan:
    """The plan at ``tp``: automatic pairing with no plan given, the model's own plan completed by it
    (:func:`fxshard.plan.auto.complete_plan`), a user's or decorators' plan as it is."""
    if tp == 1:
        return given
    if given.source == "auto":
        return auto_plan(gm, ops, params, user_inputs, tp)
    if given.source == "model":
        return complete_plan(gm, ops, params, user_inputs, tp, given)
    return dataclasses.replace(given, warnings=[])


def _plan_placements(gm: fx.GraphModule, ops: list[WeightOp], ctx: CompileContext, given: ResolvedPlan, tp: int,
                     notes: list[str]):
    """The plan at ``tp`` and what it gives: ``(plan, weights' placements, forced outputs, roles)``.  A peft model's
    LoRA layers are planned as their bases, their adapters placed by them (:mod:`fxshard.plan.lora`)."""
    layers = lora_layers(gm, ops, ctx.program.model) if tp > 1 else []
    if not layers:
        plan = _planned(gm, ops, ctx.params, ctx.user_inputs, given, tp)
        return (plan, *_weight_placements(ops, plan, notes, tp))
    return plan_lora(gm, ops, layers, ctx.params, ctx.user_inputs,
                     lambda view, o, params, inputs: _planned(view, o, params, inputs, given, tp),
                     lambda o, plan: _weight_placements(o, plan, notes, tp), tp)


def apply_propagation(gm: fx.GraphModule, prop: Propagation, ctx: CompileContext,
                      roles: dict[str, str] | None = None) -> None:
    """Make ``gm`` compute one tp rank's part as ``prop`` decided: record each node's placement and the
    placements its inputs need (for the collectives pass), localize shape constants, and apply the rules'
    rewrites.  Split across from :func:`tensor_parallel_pass` so a test can drive any placements of its
    own through the same rewrites::

        apply_propagation(gm, propagate(gm, {weight: Shard(0)}), ctx)
    """
    tp = ctx.layout.tp
    roles = roles or {}
    for node in prop.fallbacks:
        ctx.notes.append(f"{node_fqn(node) or 'model'}: {_op_name(node)} has no sharding rule for its split "
                         "inputs; they are all-gathered first")
    for node in gm.graph.nodes:
        d = prop.decisions[node]
        update_spec(node, placement=d.out, fqn=node_fqn(node), role=roles.get(node_fqn(node), ""), inputs=d.inputs)
    for node in list(gm.graph.nodes):
        d = prop.decisions[node]
        if node.op != "call_function":
            continue
        localize_sizes(node, d.out, d.inputs[0] if d.inputs else None, tp)
        if d.rewrite == "bias_after_reduce":
            _bias_after_reduce(gm, node, ctx.layout.sp)
        elif d.rewrite == "vocab_embedding":
            _vocab_embedding(node, tp)
        elif d.rewrite == "vocab_cross_entropy":
            _vocab_cross_entropy(gm, node, tp)
        elif d.rewrite == "mean_of_parts":
            _mean_of_parts(gm, node, tp)


def _refuse_parameter_writes(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """A forward that writes a parameter in place (nn.Embedding's ``max_norm`` renormalizes the rows it looks
    up) writes, under data parallelism, only the rows of its own part of the batch: the replicas would hold
    different weights from then on, where one device writes the rows of the whole batch."""
    if ctx.layout.dp == 1:
        return
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for target in written_inputs(node):
            base = target
            while base.op == "call_function" and base.args and isinstance(base.args[0], fx.Node) \
                    and base.target in _VIEWS:
                base = base.args[0]
            if base in ctx.params:
                what = ("nn.Embedding(max_norm=...) renormalizes the rows of its weight it looks up"
                        if node.target is aten.embedding_renorm_.default else f"{_op_name(node)} writes it")
                raise ShardingError(
                    f"{node_fqn(node) or 'model'}: the forward writes the parameter "
                    f"{ctx.program.state_by_name()[base.name].fqn} in place ({what}); under dp={ctx.layout.dp} "
                    "each replica would write only the rows of its own part of the batch and the replicas would "
                    "drift apart. Drop the in-place update (e.g. max_norm=None) or use dp=1")


_VIEWS = {aten.detach.default, aten.view.default, aten.alias.default, aten.t.default, aten.transpose.int,
          aten.slice.Tensor, aten.select.int}


def _op_name(node: fx.Node) -> str:
    if not callable(node.target) or hasattr(node.target, "_schema"):
        return str(node.target).replace("aten::", "aten.")
    return node.target.__name__


def _weight_placements(ops: list[WeightOp], plan: ResolvedPlan, notes: list[str], tp: int):
    weights: dict[fx.Node, Placement] = {}
    owner: dict[fx.Node, str] = {}
    forced, roles = {}, {}
    styled = set()
    for op in ops:
        style = plan.styles.get(op.fqn)
        if style is None:
            continue
        styled.add(op.fqn)
        if style.gather_output and style.kind != "colwise":
            raise PlanError(f"{op.fqn}: gather_output applies to colwise(); got {style}")
        for tensor, placement in style_placements(op, style, tp).items():
            if tensor in weights and weights[tensor] != placement:
                raise PlanError(
                    f"{op.fqn}: the plan gives its weight {placement} on tp, but the same tensor "
                    f"(tied with {owner[tensor]}) is {weights[tensor]} there; give both modules styles that "
                    "split the shared weight the same way (e.g. vocab_parallel() embedding with a "
                    "colwise(gather_output=True) head)"
                )
            weights[tensor] = placement
            owner[tensor] = op.fqn
        if style.gather_output and _feeds_cross_entropy(op.node, vocab_parallel_loss):
            notes.append(f"{op.fqn}: its logits reach the cross entropy split by class (vocab-parallel), "
                         "not gathered; they are gathered only where needed whole (e.g. returned)")
        elif style.gather_output:
            forced[op.node] = Replicate()
            if _feeds_cross_entropy(op.node, lambda u: u.target is aten.cross_entropy_loss.default):
                notes.append(f"{op.fqn}: its logits are gathered whole for the cross entropy: class weights, "
                             "label smoothing and probability targets have no vocab-parallel form")
        roles[op.fqn] = style.role
    for fqn, style in plan.styles.items():
        if fqn not in styled and style.kind not in ("replicate", "experts"):  # experts: fxshard/plan/experts.py
            msg = (f"{plan.sources.get(fqn, 'plan')} plan entry for {fqn!r} ({style}): the module has no "
                   "Linear/Conv1D/Embedding op of its own; name the layers inside it instead")
            plan.warnings.append(msg)
            notes.append(msg)
    return weights, forced, roles


_TRANSPARENT = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.contiguous.default,
                aten.clone.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.flatten.using_ints}


def _feeds_cross_entropy(node: fx.Node, loss) -> bool:
    """Whether ``node`` (a head's logits) reaches, through reshapes and casts only, a node ``loss(node)``
    accepts (a cross entropy)."""
    return any(u.args and u.args[0] is node and (loss(u) or u.target in _TRANSPARENT and _feeds_cross_entropy(u, loss))
               for u in node.users)


def _unsplittable(gm: fx.GraphModule, prop: Propagation, tp: int) -> tuple[fx.Node, Shard, int] | None:
    """The first value whose split dimension ``tp`` does not divide (per packed block): node, placement, size."""
    for node in gm.graph.nodes:
        outs = prop.decisions[node].out
        vals = node.meta.get("val")
        pairs = zip(outs, vals, strict=False) if isinstance(outs, tuple) else [(outs, vals)]
        for p, v in pairs:
            if isinstance(p, Shard) and isinstance(v, torch.Tensor) and not p.divides(int(v.shape[p.dim]), tp):
                return node, p, int(v.shape[p.dim])
    return None


def _check_divisible(gm: fx.GraphModule, prop: Propagation, tp: int, ctx: CompileContext,
                     ops: list[WeightOp], experts: dict[fx.Node, Placement], given: ResolvedPlan) -> None:
    found = _unsplittable(gm, prop, tp)
    if found is not None:
        node, p, size = found
        per_block = next((b for i, b in enumerate(p.block_sizes(size)) if b % p.parts_of(i, tp)), size // p.blocks)
        ok = _degrees_that_split(gm, ops, ctx, per_block, experts, given)
        raise ShardingError(_divisibility_message(node, p, size, per_block, tp, ctx, ok))


_LARGEST_TP = 1024  # degrees offered go no higher: each is checked by a propagation over the whole graph


def _degrees_that_split(gm: fx.GraphModule, ops: list[WeightOp], ctx: CompileContext, size: int,
                        experts: dict[fx.Node, Placement], given: ResolvedPlan) -> list[int]:
    """The tp degrees to suggest: those dividing the failing ``size`` (a necessary condition) for which the
    same plan (re-planned at that degree when automatic) passes the same check on every split value —
    heads, key/value heads, packed blocks, vocabulary — so a suggested degree never fails on the next size."""
    ok = []
    for d in (d for d in divisors(size) if d <= _LARGEST_TP):
        _, weights, forced, _ = _plan_placements(gm, ops, ctx, given, d, [])
        weights |= experts if d > 1 else {}
        if d == 1 or _unsplittable(gm, propagate(gm, weights, forced), d) is None:
            ok.append(d)
    return ok


def _divisibility_message(node, p: Shard, size: int, per_block: int, tp: int, ctx: CompileContext,
                          ok: list[int]) -> str:
    fqn = node_fqn(node) or "model"
    if node.op == "placeholder":
        tensor = ctx.program.state_by_name()[node.name].fqn
        fqn = tensor.rsplit(".", 1)[0] if "." in tensor else fqn  # the module that holds the weight
        blocks = f": {p.blocks} packed blocks of {per_block}" if p.blocks > 1 else ""
        what = f"dimension {p.dim} of {tensor} (size {size}{blocks})"
    else:
        packed = " per packed block" if p.blocks > 1 else ""
        what = f"{_op_name(node)} output dimension {p.dim} (size {per_block}{packed})"
        module = dict(ctx.program.model.named_modules()).get(fqn)
        config = getattr(ctx.program.model, "config", None)
        for holder in (module, config):
            for attr in _HEAD_ATTRS:
                if holder is not None and getattr(holder, attr, None) == per_block and node.target in SIZED:
                    label = "key/value heads" if "kv" in attr or "key_value" in attr else "heads"
                    what = f"{per_block} {label} ({attr})"
                    break
            else:
                continue
            break
    return f"{fqn}: {what} cannot be split over tp={tp}; use tp in {{{', '.join(map(str, ok))}}}"


def _mean_of_parts(gm: fx.GraphModule, node: fx.Node, tp: int) -> None:
    """A mean over the split dimension: each rank's mean of its equal part, divided by tp, sums to the mean."""
    with gm.graph.inserting_after(node):
        div = gm.graph.call_function(aten.div.Tensor, (node, float(tp)))
    node.replace_all_uses_with(div, delete_user_cb=lambda u: u is not div)
    div.meta["val"] = node.meta["val"]
    div.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    old = spec(node)
    div.meta["fxshard"] = NodeSpec(old.placement, old.fqn, old.role, inputs=(old.placement,))


def _bias_after_reduce(gm: fx.GraphModule, node: fx.Node, sp: bool = False) -> None:
    """``linear(x, W, b)`` -> ``linear(x, W)`` (partial sums) then ``+ b`` after the all-reduce (under ``sp``, after
    the reduce-scatter over tokens, on this rank's tokens)."""
    if node.target is aten.linear.default:
        x, w, b = (argument(node, name) for name in ("input", "weight", "bias"))
        inputs = spec(node).inputs[:2]
    else:  # addmm(b, x, w) -> mm(x, w)
        b, x, w = (argument(node, name) for name in ("self", "mat1", "mat2"))
        node.target = aten.mm.default
        inputs = spec(node).inputs[1:]
    node.args, node.kwargs = (x, w), {}
    update_spec(node, inputs=inputs)
    tokens = _token_need(node) if sp else None  # reduce-scattered: the bias added to this rank's tokens
    if tokens is not None:
        along = tokens.dim % len(shape(node)) - (len(shape(node)) - len(shape(b)))  # the bias's dim it splits
        if along >= 0 and shape(b)[along] != 1:  # a split of the hidden size, not of tokens: add the bias whole
            tokens = None
    with gm.graph.inserting_after(node):
        add = gm.graph.call_function(aten.add.Tensor, (node, b))
    node.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
    add.meta["val"] = node.meta["val"]
    add.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    old = spec(node)
    out = tokens or Replicate()
    add.meta["fxshard"] = NodeSpec(out, old.fqn, old.role, inputs=(out, Replicate()))


def _token_need(node: fx.Node) -> Shard | None:
    """The split a consumer takes the partial sums ``node`` in (sequence parallelism: split over tokens)."""
    for user in node.users:
        for arg, need in zip(tensor_args(user), spec(user).inputs or (), strict=False):
            if arg is node and isinstance(need, Shard):
                return need
    return None


def _vocab_embedding(node: fx.Node, tp: int) -> None:
    weight, ids = node.args[:2]
    padding_idx = argument(node, "padding_idx")
    rows = _rank_range(shape(weight)[0], tp)
    node.target = rt_tp.vocab_embedding
    node.args = (weight, ids)
    node.kwargs = rows
    if padding_idx >= 0:  # the padding row, indexed among the rows of the rank that holds it
        starts, ends = rows["start"].values, rows["end"].values
        node.kwargs = rows | {"padding_idx": RankValue(TP, tuple(
            padding_idx - s if s <= padding_idx < e else -1 for s, e in zip(starts, ends, strict=True)))}


def _rank_range(size: int, tp: int) -> dict[str, RankValue]:
    """``start``/``end`` of each tp rank's equal part of a dimension of ``size`` (rows, classes)."""
    part = size // tp
    return {"start": RankValue(TP, tuple(r * part for r in range(tp))),
            "end": RankValue(TP, tuple((r + 1) * part for r in range(tp)))}


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # aten's Reduction enum


def _vocab_cross_entropy(gm: fx.GraphModule, node: fx.Node, tp: int) -> None:
    """``cross_entropy_loss(logits S(1), target)`` -> per-rank parts (S(1) of ``[N, tp, 2]``), then the loss
    from the gathered parts; the collectives pass inserts the all-gather between the two."""
    logits, target = node.args[:2]
    reduction, ignore_index = argument(node, "reduction"), argument(node, "ignore_index")
    with gm.graph.inserting_before(node):
        parts = gm.graph.call_function(rt_tp.vocab_cross_entropy_parts, (logits, target),
                                       _rank_range(shape(logits)[1], tp))
    val = logits.meta["val"]
    parts.meta["val"] = val.new_empty((shape(logits)[0], tp, 2), dtype=rt_tp.reduction_dtype(val.dtype))
    parts.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    old = spec(node)
    role = "vocab-parallel cross entropy"
    parts.meta["fxshard"] = NodeSpec(Shard(1), old.fqn, role, inputs=old.inputs)
    node.target = rt_tp.vocab_cross_entropy
    node.args = (parts, target)
    kwargs = {"ignore_index": ignore_index, "reduction": _REDUCTIONS[reduction]}
    if val.dtype != parts.meta["val"].dtype:
        kwargs["dtype"] = val.dtype
    node.kwargs = kwargs
    update_spec(node, role=role, inputs=(Replicate(), Replicate()))
