"""Insert the communication that makes every op see the placements it needs.

For each tensor input, compare the placement it has with the placement its consumer requires
(recorded by the tensor-parallel pass) and insert an explicit node:

==========================  ==================  =============================================
has -> needs                node                why
==========================  ==================  =============================================
P(sum) -> R                 ``all_reduce``      row-parallel output, vocab-parallel lookup
S(d) -> R                   ``all_gather``      gathered head, op without a sharding rule
R -> S(d), needs a grad     ``scatter``         slice forward, all-gather the gradient back
R -> S(d), no grad          ``shard``           slice a mask/table, no communication
R -> R into sharded compute ``copy_to``         Megatron's *f*: all-reduce the gradient back
==========================  ==================  =============================================

Under ``--sp`` (sequence parallelism, decided by the tensor-parallel pass's propagation) two more:

==========================  ==================  =============================================
P(sum) -> S(d)              ``reduce_scatter``  row-parallel output split over tokens; backward
                                                all-gathers the gradient
S(d) -> R into sharded      ``gather_to``       all-gather forward, reduce-scatter of the
compute                                         gradient backward (not all_gather + copy_to,
                                                whose backward all-reduces: twice the bytes)
==========================  ==================  =============================================

A partial sum that some consumer takes split over tokens is reduce-scattered once, and gathered from there
for any consumer that needs it whole (the bytes of one all-reduce).

A replicated node marked ``enters`` (an experts module's dispatch: the tokens' rows gathered for its first grouped
matmul) counts as split compute for its inputs, and its consumers take it as it is: the ``copy_to`` goes on the
``[T, H]`` tokens before the gather, not on the ``[T*k, H]`` rows after it.

Each kind of redistribution of a value is inserted once and shared by all its consumers, so q, k
and v share one ``copy_to`` — one backward all-reduce per attention block, as in Megatron.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.ir.autograd import requires_grad
from fxshard.ir.comm import KINDS
from fxshard.ir.context import TP, CompileContext, Group, NodeSpec, RankValue, spec
from fxshard.ir.contracts import COMMUNICATED, PLACED, contract
from fxshard.ir.placement import Partial, Placement, Replicate, Shard
from fxshard.ir.sharding import tensor_args

R = Replicate()
GROUP = Group(TP)


@contract(requires=(PLACED,), ensures=(COMMUNICATED,))
def collectives_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    tp = ctx.layout.tp
    grad = requires_grad(gm, ctx.trainable)
    made: dict[tuple, fx.Node] = {}
    scattered = _token_splits(gm) if ctx.layout.sp else None
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "output"):
            continue
        required = spec(node).inputs
        if required is None:
            continue
        args = tensor_args(node)
        out = spec(node).placement
        sharded_out = spec(node).enters or any(isinstance(p, (Shard, Partial))
                                               for p in (out if isinstance(out, tuple) else (out,)))
        replace = {}
        for arg, need in zip(args, required, strict=True):
            new = _redistribute(gm, arg, need, node, sharded_out, arg in grad, made, tp, scattered)
            if new is not arg:
                replace[arg] = new
        if replace:
            node.args = fx.node.map_arg(node.args, lambda a: replace.get(a, a))
            node.kwargs = fx.node.map_arg(node.kwargs, lambda a: replace.get(a, a))
    gm.graph.lint()
    return gm


def _token_splits(gm: fx.GraphModule) -> dict[fx.Node, Shard]:
    """Partial sums some consumer needs split (over tokens, under ``--sp``) -> that split: reduce-scattered."""
    found = {}
    for node in gm.graph.nodes:
        required = spec(node).inputs if node.op in ("call_function", "output") else None
        for arg, need in zip(tensor_args(node), required or (), strict=False):
            if isinstance(spec(arg).placement, Partial) and isinstance(need, Shard):
                found.setdefault(arg, need)
    return found


def _redistribute(gm, arg: fx.Node, need: Placement, consumer: fx.Node, sharded_out: bool, grad: bool,
                  made: dict, tp: int, scattered: dict[fx.Node, Shard] | None) -> fx.Node:
    """The node giving ``consumer`` the value ``arg`` at placement ``need``; ``grad``: a gradient flows back
    through ``arg`` (and so through what is inserted for it); ``scattered``: under ``--sp``, the partial sums to
    reduce-scatter (None without)."""
    has = spec(arg).placement
    again = (sharded_out, grad, made, tp, scattered)
    if has == need:
        if has == R and sharded_out and grad and consumer.op != "output" and not spec(arg).enters:
            return _make(gm, made, ("copy_to", arg), (arg, GROUP), {}, R, consumer, consumer)
        return arg
    if isinstance(has, Partial) and scattered and arg in scattered:
        split = scattered[arg]
        reduced = _make(gm, made, ("reduce_scatter", arg), (arg, GROUP), _split_kwargs(split), split, arg, None)
        return _redistribute(gm, reduced, need, consumer, *again)
    if isinstance(has, Partial):
        reduced = _make(gm, made, ("all_reduce", arg), (arg, GROUP), {}, R, arg, None)
        return _redistribute(gm, reduced, need, consumer, *again)
    if isinstance(has, Shard) and scattered is not None and need == R and sharded_out and grad \
            and consumer.op != "output":
        return _make(gm, made, ("gather_to", arg), (arg, GROUP), _split_kwargs(has), R, arg, consumer)
    if isinstance(has, Shard):
        gathered = _make(gm, made, ("all_gather", arg), (arg, GROUP),
                         {"dim": has.dim, "blocks": has.blocks}, R, arg, consumer)
        return _redistribute(gm, gathered, need, consumer, *again)
    assert isinstance(need, Shard), (arg, has, need)
    index = RankValue(TP, tuple(range(tp)))
    if grad:
        return _make(gm, made, ("scatter", arg, need), (arg, GROUP),
                     {"dim": need.dim, "index": index, "parts": tp, "blocks": need.blocks}, need, consumer, consumer)
    return _make(gm, made, ("shard", arg, need), (arg,),
                 {"dim": need.dim, "index": index, "parts": tp, "blocks": need.blocks}, need, consumer, consumer)


def _split_kwargs(split: Shard) -> dict:
    return {"dim": split.dim} | ({"blocks": split.blocks} if split.blocks > 1 else {})


def _make(gm, made, key, args, kwargs, placement, owner: fx.Node, before: fx.Node | None) -> fx.Node:
    """Create (once per key) a redistribution node of kind ``key[0]`` (:mod:`fxshard.ir.comm`); provenance
    (FQN, role) from ``owner``.

    It goes before its first consumer ``before``, or right after the value it reduces when
    ``before`` is None (a reduction belongs to the layer that made the partial sums).
    """
    if key in made:
        return made[key]
    src = args[0]
    where = gm.graph.inserting_after(src) if before is None else gm.graph.inserting_before(before)
    with where:
        node = gm.graph.call_function(KINDS[key[0]].function, args, kwargs)
    node.meta["val"] = src.meta.get("val")
    node.meta["nn_module_stack"] = owner.meta.get("nn_module_stack", {})
    node.meta["fxshard"] = NodeSpec(placement, spec(owner).fqn, spec(owner).role, key[0])
    made[key] = node
    return node
