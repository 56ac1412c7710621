"""Attention across the cp ranks, written as explicit lines in one of three modes (``--cp-mode``).

Called by ``passes/context_parallel.py`` for each ``scaled_dot_product_attention`` whose queries, keys and values are
split along their sequence; ``split`` is that pass's walk (its placements, and how it enters input-only values and
gathers split ones).  Each function leaves the attention's output split along the sequence, as the tokens it feeds::

    allgather(split, node)   # rt.gather_to(K), rt.gather_to(V); SDPA of this rank's queries (causal: by chunks)
    ring(split, node)        # cp lines of rt.ring_attention_step / _last, then rt.merge_attention
    a2a(split, node)         # rt.seq_to_heads of q, k, v; SDPA of 1/cp of the heads; rt.heads_to_seq
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from fxshard.errors import ShardingError
from fxshard.graph import node_fqn
from fxshard.ir.cp_rules import cp_rule
from fxshard.ir.placement import Replicate, Shard
from fxshard.ir.sharding import argument, rule_decision, set_argument, shape
from fxshard.ir.spec import Group
from fxshard.runtime import context_parallel as rcp

aten = torch.ops.aten
R = Replicate()
GROUP = Group("cp")


def allgather(split, node: fx.Node) -> None:
    """K and V all-gathered over cp (hoisted above ``repeat_kv``); this rank's queries attend over every key.  A
    causal attention (``is_causal``: passes/causal_attention.py proves a model's mask causal) becomes
    ``rt.cp_causal_attention``: each load-balanced query chunk over the chunks before it unmasked and over itself with
    ``is_causal``, merged by log-sum-exp, so no S x S mask is made or saved."""
    q, k, v = node.args[:3]
    n = len(shape(node))
    for i, x in ((1, k), (2, v)):
        new = split.gather(x)
        if new is not x:
            node.update_arg(i, new)
    if argument(node, "is_causal") and argument(node, "attn_mask") is None:
        attend = split._insert(rcp.cp_causal_attention, (q, GROUP), {
            "key": node.args[1], "value": node.args[2], "scale": _scale(node), "balanced": split.balanced},
            before=node, val=node.meta["val"], placement=Shard(n - 2), collective="cp_causal_attention", owner=node)
        node.replace_all_uses_with(attend)
        _erase(split, [node])
        return
    _mask(split, node, [Shard(n - 2), R, R])
    split.place[node] = Shard(n - 2)


def ring(split, node: fx.Node) -> None:
    """cp ring steps: step s attends over the K/V block of cp rank (index - s) while it travels on, then the blocks'
    outputs merge by their log-sum-exp.  Grouped-query attention sends the key/value heads and repeats them after."""
    q, k, v = node.args[:3]
    n = len(shape(node))
    (key, value), groups, chains = _sources(k, v)
    causal = bool(argument(node, "is_causal"))
    mask = None if causal else _mask(split, node, None)
    qv, outs, lses = q.meta["val"], [], []
    common = {"query": q, "mask": mask, "causal": causal, "scale": _scale(node), "kv_groups": groups,
              "balanced": split.balanced}
    for s in range(split.cp):
        last = s == split.cp - 1
        fn = rcp.ring_attention_last if last else rcp.ring_attention_step
        vals = (qv.new_empty(shape(node), dtype=torch.float32), qv.new_empty(shape(node)[:-1], dtype=torch.float32))
        places = (Shard(n - 2), Shard(n - 2))
        if not last:
            vals += (key.meta["val"], value.meta["val"])
            places += (split.place[key], split.place[value])
        step = split._insert(fn, (key, GROUP), {"step": s, "value": value, **common}, before=node, val=vals,
                             placement=places, collective=fn.__name__, owner=node)
        parts, prev = [], step
        for i in range(len(vals)):
            prev = _item(split, step, i, node, prev)
            parts.append(prev)
        outs.append(parts[0])
        lses.append(parts[1])
        if not last:
            key, value = parts[2], parts[3]
    merged = split._insert(rcp.merge_attention, (outs, lses), {"dtype": node.meta["val"].dtype}, before=node,
                           val=node.meta["val"], placement=Shard(n - 2), owner=node)
    node.replace_all_uses_with(merged)
    _erase(split, [node] + [c for chain in chains for c in reversed(chain)])


def a2a(split, node: fx.Node) -> None:
    """Ulysses: an all-to-all takes q, k and v from 1/cp of the tokens with every head to every token with 1/cp of
    the heads (in the natural order), attention runs there, an all-to-all takes its output back.  Key/value heads
    travel before ``repeat_kv`` when cp·tp divides them."""
    q, k, v = node.args[:3]
    n, heads, parts = len(shape(node)), shape(q)[1], split.cp * split.ctx.layout.tp
    if heads % parts:
        ok = [c for c in range(1, heads + 1) if heads % (c * split.ctx.layout.tp) == 0]
        raise ShardingError(f"{node_fqn(node) or 'model'}: --cp-mode a2a splits the {heads} attention heads over "
                            f"cp x tp = {parts} ranks, which do not divide them; use --cp in {ok} at this --tp, or "
                            "--cp-mode allgather or ring")
    (ks, vs), groups, chains = _sources(k, v)
    if groups > 1 and shape(ks)[1] % parts:
        (ks, vs), chains = (k, v), [[], []]
    for i, (src, chain) in enumerate(((q, []), (ks, chains[0]), (vs, chains[1]))):
        moved = split._insert(rcp.seq_to_heads, (src, GROUP), {"head_dim": 1, "seq_dim": len(shape(src)) - 2,
                                                                "balanced": split.balanced}, after=src,
                              val=src.meta["val"], placement=Shard(1), collective="seq_to_heads", owner=node)
        if not chain:
            node.update_arg(i, moved)
            continue
        chain[0].replace_input_with(src, moved)
        p = Shard(1)
        for c in chain:
            p = rule_decision(c, [c.args[0]], [p]).out
            split.place[c] = p
    _mask(split, node, [Shard(1)] * 3, permute=False)
    split.place[node] = Shard(1)
    back = split._insert(rcp.heads_to_seq, (node, GROUP), {"head_dim": 1, "seq_dim": n - 2, "balanced": split.balanced},
                         after=node, val=node.meta["val"], placement=Shard(n - 2), collective="heads_to_seq",
                         owner=node)
    node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)


def _mask(split, node: fx.Node, qkv: list | None, permute: bool = True) -> fx.Node | None:
    """The attention's mask as the rewritten attention needs it: split along its query rows (whole along keys, in
    the cp order), or by heads under a2a (``qkv``: q/k/v's placements for the rule; None: the rows rule)."""
    mask = argument(node, "attn_mask")
    if mask is None:
        return None
    if qkv is None:
        s = shape(mask)
        need = R if len(s) < 2 or s[-2] == 1 else Shard(len(s) - 2)
    else:
        args = [*node.args[:3], mask]
        placements = [*qkv, R]
        decision = cp_rule(node, args, placements) or rule_decision(node, args, placements)
        if decision is None:
            raise ShardingError(f"{node_fqn(node) or 'model'}: no cp rule for this attention's mask "
                                f"{list(shape(mask))}")
        need = decision.inputs[3]
    if mask in split.whole:
        new = split.enter(mask, need, permute)
    elif split.place.get(mask, R) == need:
        new = mask
    else:
        raise ShardingError(f"{node_fqn(node) or 'model'}: the attention mask is computed from the model's weights "
                            f"and split as {split.place.get(mask, R)}; --cp needs it {need}")
    set_argument(node, "attn_mask", new)
    return new


def _sources(k: fx.Node, v: fx.Node):
    """The key and value before transformers' ``repeat_kv`` (``reshape(expand(unsqueeze(x, 2)))``), the query heads
    per key/value head, and the two repeat chains; the attention's own key and value (groups 1) otherwise."""
    found = [_repeat_source(x) for x in (k, v)]
    if found[0][1] != found[1][1] or found[0][1] == 1:
        return (k, v), 1, [[], []]
    return (found[0][0], found[1][0]), found[0][1], [found[0][2], found[1][2]]


def _repeat_source(x: fx.Node):
    views = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
    e = x.args[0] if x.op == "call_function" and x.target in views else None
    u = e.args[0] if e is not None and e.target is aten.expand.default else None
    if u is None or u.target is not aten.unsqueeze.default or argument(u, "dim") != 2:
        return x, 1, []
    if len(u.users) != 1 or len(e.users) != 1 or len(shape(e)) != 5:
        return x, 1, []
    return u.args[0], shape(e)[2], [u, e, x]


def _item(split, step: fx.Node, i: int, owner: fx.Node, after: fx.Node) -> fx.Node:
    with split.gm.graph.inserting_after(after):
        item = split.gm.graph.call_function(operator.getitem, (step, i))
    item.meta["val"] = step.meta["val"][i]
    item.meta["nn_module_stack"] = owner.meta.get("nn_module_stack", {})
    item.meta["fxshard"] = step.meta["fxshard"].__class__(fqn=step.meta["fxshard"].fqn)
    split.place[item] = split.place[step][i]
    return item


def _erase(split, nodes: list[fx.Node]) -> None:
    for node in nodes:
        if not node.users:
            split.gm.graph.erase_node(node)
            split.erased.add(node)


def _scale(node: fx.Node) -> float:
    scale = argument(node, "scale")
    return scale if scale is not None else 1 / math.sqrt(shape(node.args[0])[-1])
