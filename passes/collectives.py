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

Parts that several ranks hold alike (``S(d)/g``, g parts over tp ranks: key/value heads fewer than tp, a Mamba-2
mixer's B and C when its groups are fewer than tp) have partial gradients, each rank's covering what its own
computation read:

==========================  ==================  =============================================
S(d)/g -> S(d)              ``own_part``        this rank's share of the part (no communication)
S(d)/g weight, needs grad   ``sum_replicas``    identity forward; backward sums the replicas'
                                                gradients, one all-reduce for a layer's weights
==========================  ==================  =============================================

A replicated node marked ``enters`` (an experts module's dispatch: the tokens' rows gathered for its first grouped
matmul) counts as split compute for its inputs, and its consumers take it as it is: the ``copy_to`` goes on the
``[T, H]`` tokens before the gather, not on the ``[T*k, H]`` rows after it.

Each kind of redistribution of a value is inserted once and shared by all its consumers, so q, k
and v share one ``copy_to`` — one backward all-reduce per attention block, as in Megatron.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from fxshard.errors import ShardingError
from fxshard.graph import data_sized, node_fqn
from fxshard.ir.autograd import requires_grad
from fxshard.ir.comm import KINDS
from fxshard.ir.context import TP, CompileContext, Group, NodeSpec, RankValue, spec
from fxshard.ir.placement import Partial, Placement, Replicate, Shard
from fxshard.ir.sharding import tensor_args

R = Replicate()
GROUP = Group(TP)


def collectives_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    tp = ctx.layout.tp
    grad = requires_grad(gm, ctx.trainable)
    made: dict[tuple, fx.Node] = {}
    scattered = _token_splits(gm) if ctx.layout.sp else None
    _sum_replicas(gm, ctx, grad, tp)
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
    _refuse_data_sized(made.values())
    return gm


def _refuse_data_sized(collectives) -> None:
    """A collective whose tensor has a size only the data decides (the rows a boolean index selects) cannot be
    listed, costed or checked before the program runs: refused, naming the module, before any code is written."""
    for node in collectives:
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else node
        if data_sized(node) or data_sized(source):
            raise ShardingError(
                f"{node_fqn(source) or 'model'}: {source.name} has a size the data decides "
                f"({list(source.meta['val'].shape)}: a boolean index, nonzero or masked_select upstream), and the "
                f"layout would send it between tp ranks (rt.{getattr(node.target, '__name__', node.target)}); "
                "fxshard lists every collective with its shape at compile time. Replicate this module in the plan "
                "(it then needs no collective), or make the size fixed (pad to a maximum and mask)")


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
    if _whole_everywhere(has) and isinstance(need, Shard) and need.blocks == 1 and not need.sizes:
        if _whole_everywhere(need):  # along any dimension: the whole value on every rank
            return arg
        if not need.general:  # this rank's share of it along the dimension asked for
            return _make(gm, made, ("own_part", arg, need), (arg,),
                         {"dim": need.dim, "index": RankValue(TP, tuple(range(tp))), "parts": tp}, need,
                         consumer, consumer)
    if isinstance(has, Shard) and has.parts and has.blocks == 1 and need == Shard(has.dim):
        k = tp // has.parts_of(0, tp)  # this rank's share of the part its k replicas hold
        if k == 1:  # as many parts as ranks: the same split
            return arg
        return _make(gm, made, ("own_part", arg, need), (arg,),
                     {"dim": has.dim, "index": RankValue(TP, tuple(r % k for r in range(tp))), "parts": k}, need,
                     consumer, consumer)
    if isinstance(has, Shard):
        gathered = _make(gm, made, ("all_gather", arg), (arg, GROUP),
                         {"dim": has.dim, "blocks": has.blocks} | _uneven(has, tp), R, arg, consumer)
        return _redistribute(gm, gathered, need, consumer, *again)
    assert isinstance(need, Shard), (arg, has, need)
    index = RankValue(TP, tuple(range(tp)))
    kwargs = {"dim": need.dim, "index": index, "parts": tp, "blocks": need.blocks} | _uneven(need, tp)
    if grad:
        return _make(gm, made, ("scatter", arg, need), (arg, GROUP), kwargs, need, consumer, consumer)
    return _make(gm, made, ("shard", arg, need), (arg,), kwargs, need, consumer, consumer)


def _whole_everywhere(p: Placement) -> bool:
    """A split of one block cut into one part (``S(d)/1``): the whole value on every rank, its gradients partial
    (an MQA model's one key/value head); the dimension it names makes no difference."""
    return isinstance(p, Shard) and p.blocks == 1 and p.parts == (1,)


def _uneven(p: Shard, tp: int) -> dict:
    """The collectives' arguments for unequal or replicated blocks (none for an ordinary split)."""
    return ({"sizes": p.sizes} if p.sizes else {}) | ({"replicas": p.replicas(tp)} if p.parts else {})


def _sum_replicas(gm: fx.GraphModule, ctx: CompileContext, grad: set, tp: int) -> None:
    """Give the weights whose parts several ranks hold alike (``S(d)/g``) one ``rt.sum_replicas`` per layer: each
    rank's gradient of such a part covers only what its own computation read (its query heads of a shared
    key/value head), and the sum over the ranks holding it is the part's gradient."""
    layers: dict[str, list[fx.Node]] = {}
    names = ctx.program.state_by_name()
    for node in gm.graph.nodes:
        p = spec(node).placement
        if node.op == "placeholder" and node in ctx.params and node in grad and isinstance(p, Shard) \
                and any(p.parts_of(b, tp) < tp for b in range(p.blocks)) and node.users:
            module = names[node.name].fqn.rsplit(".", 1)[0]
            layers.setdefault(module.rsplit(".", 1)[0] if "." in module else module, []).append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ctx.replicas = replica_lines(layers, names, tp)
    ctx.notes += [line for line in ctx.replicas if line not in ctx.notes]
    for weights in layers.values():
        first = min((u for w in weights for u in w.users), key=order.__getitem__)
        layouts = RankValue(TP, tuple(tuple(_replica_layout(w, r, tp) for w in weights) for r in range(tp)))
        with gm.graph.inserting_before(first):
            node = gm.graph.call_function(KINDS["sum_replicas"].function, (tuple(weights), GROUP), {"layouts": layouts})
        node.meta["val"] = tuple(w.meta["val"] for w in weights)
        node.meta["nn_module_stack"] = first.meta.get("nn_module_stack", {})
        node.meta["fxshard"] = NodeSpec(tuple(spec(w).placement for w in weights), spec(first).fqn, spec(first).role,
                                        "sum_replicas")
        for i, w in enumerate(weights):
            with gm.graph.inserting_before(first):
                item = gm.graph.call_function(operator.getitem, (node, i))
            item.meta["val"] = w.meta["val"]
            item.meta["nn_module_stack"] = node.meta["nn_module_stack"]
            item.meta["fxshard"] = NodeSpec(spec(w).placement, spec(first).fqn, spec(first).role, inputs=())
            w.replace_all_uses_with(item, delete_user_cb=lambda u: u is not node and u is not item)


def replica_lines(layers: dict[str, list[fx.Node]], names: dict, tp: int) -> list[str]:
    """What the plan and the compile say of parts several ranks hold, one line per kind of layer::

        model.layers.*.self_attn: k_proj.weight S(0)/2, v_proj.weight S(0)/2: 2 parts (heads or groups) over
        tp=4, each held by 2 ranks; their gradients summed over those ranks once per layer (rt.sum_replicas)
    """
    lines: dict[str, str] = {}
    for layer, weights in layers.items():
        glob = ".".join("*" if part.isdigit() else part for part in layer.split("."))
        held = []
        for w in weights:
            p = spec(w).placement
            cut = sorted({p.parts_of(b, tp) for b in range(p.blocks) if p.parts_of(b, tp) < tp})
            held.append((names[w.name].fqn[len(layer) + 1:], p, cut))
        counts = sorted({g for _, _, cut in held for g in cut})
        what = " or ".join(f"{g} part{'s' * (g > 1)} "
                           f"({'whole on every rank' if g == 1 else f'each held by {tp // g} ranks'})"
                           for g in counts)
        lines.setdefault(glob, f"{glob}: {', '.join(f'{name} {p}' for name, p, _ in held)}: fewer heads or groups "
                               f"than tp={tp}, cut into {what}; their gradients summed over the ranks holding each "
                               "part once per layer (rt.sum_replicas)")
    return list(lines.values())


def _replica_layout(weight: fx.Node, rank: int, tp: int) -> tuple:
    """``(dim, ((start, length, slot, slots), ...))`` of ``rt.sum_replicas`` for ``weight`` on tp rank ``rank``."""
    p = spec(weight).placement
    size = int(weight.meta["val"].shape[p.dim])
    pieces, start = [], 0
    for b, block in enumerate(p.block_sizes(size)):
        k = tp // p.parts_of(b, tp)
        length = block * k // tp
        if k > 1:
            pieces.append((start, length, rank // k, tp // k))
        start += length
    return p.dim, tuple(pieces)


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
