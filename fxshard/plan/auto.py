"""Automatic Megatron pairing, used when no plan or decorator says anything, and for the modules a model's own
(shipped) plan does not name.

Within one module (an MLP, an attention block) a Linear whose input is computed only from other
Linears of the same module — through elementwise ops, reshapes, attention — is row-parallel, and
those Linears are column-parallel.  Values that carry no gradient (masks, rotary tables) may join
on the way.  q/k/v then split on head boundaries because the reshapes to heads follow the column
split; a fused projection split into equal parts afterwards is packed (GPT-2 ``c_attn``: 3).
An unpaired Linear that feeds the loss is a column-parallel head with its output gathered, and an
Embedding indexed by a user input is split over the vocabulary.  Every candidate is validated by
propagating placements: a pair whose module would need a gather inside it is dropped.

A shipped plan is often partial (Bamba and Falcon-H1 name only their embedding, Jamba only its experts), so
:func:`complete_plan` pairs the modules it leaves out; its own entries win where they speak, and a pair any of whose
Linears lies within a module the plan names is not made (half a pair would split where the plan chose not to).
A user's plan or decorators are taken as the whole plan: no pairing is added to them.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from fxshard.graph import ancestors, data_sized, node_fqn, walk
from fxshard.ir.autograd import requires_grad
from fxshard.ir.placement import Replicate
from fxshard.ir.sharding import propagate
from fxshard.plan.layers import WeightOp, style_placements
from fxshard.plan.packing import pieces
from fxshard.plan.styles import ResolvedPlan, Style, colwise, rowwise, vocab_parallel


def _within(fqn: str, scope: str) -> bool:
    return fqn == scope or fqn.startswith(scope + ".")


def _parent(fqn: str) -> str | None:
    return fqn.rsplit(".", 1)[0] if "." in fqn else None


def _row_candidates(gm, ops: list[WeightOp], params: set[fx.Node]) -> list[tuple[WeightOp, list[WeightOp]]]:
    by_node = {op.node: op for op in ops}
    grad = requires_grad(gm, params)
    pairs = []
    for op in ops:
        if op.kind == "embedding" or _parent(op.fqn) is None:
            continue
        scope = _parent(op.fqn)
        x = op.node.args[0] if op.kind == "linear" else op.node.args[1]
        ups, ok = {}, True

        def inputs(n, scope=scope):  # the walk goes on through the trained values of the module's own ops
            inside = n not in by_node and n in grad and n.op != "placeholder" and _within(node_fqn(n), scope)
            return n.all_input_nodes if inside else ()

        for n in walk([x], inputs):
            if n in by_node:
                up = by_node[n]
                ok = up.kind != "embedding" and _within(up.fqn, scope)
                ups[up.node] = up
            elif n in grad and n.op != "placeholder" and not _within(node_fqn(n), scope):
                ok = False
            if not ok:
                break
        if ok and ups:
            pairs.append((op, sorted(ups.values(), key=lambda u: list(gm.graph.nodes).index(u.node))))
    return pairs


def _reaches_output(gm, op: WeightOp, weight_nodes: set[fx.Node]) -> bool:
    return any(u.op == "output" for n in walk([op.node], lambda n: [u for u in n.users if u not in weight_nodes])
               for u in n.users)


def _from_user_input(node: fx.Node, user_inputs: set[fx.Node]) -> bool:
    return any(n in user_inputs for n in ancestors([node]))


def complete_plan(gm: fx.GraphModule, ops: list[WeightOp], params: set[fx.Node], user_inputs: set[fx.Node],
                  tp: int, given: ResolvedPlan) -> ResolvedPlan:
    """``given`` (a model's own plan) with automatic pairing for the modules it does not name; ``source`` becomes
    ``model+auto`` when pairing added any::

        complete_plan(gm, ops, ctx.params, ctx.user_inputs, 2, ctx.plan).describe()
        # ['model.embed_tokens: vocab()  [model]', 'model.layers.0.mlp.down_proj: rowwise()  [auto]', ...]
    """
    fixed = {op: given.styles[op.fqn] for op in ops if op.fqn in given.styles}
    added = auto_plan(gm, ops, params, user_inputs, tp, named=set(given.styles), fixed=fixed)
    if not added.styles:
        return given
    return dataclasses.replace(given, styles=given.styles | added.styles, sources=given.sources | added.sources,
                               source=f"{given.source}+auto")


def _pair_styles(chosen: list[tuple[WeightOp, list[WeightOp]]]) -> dict[WeightOp, Style]:
    styles: dict[WeightOp, Style] = {}
    for row, cols in chosen:
        styles[row] = rowwise()
        for c in cols:
            blocks = pieces(c.node)
            styles[c] = colwise(packed=len(blocks) if len(set(blocks)) == 1 else 0)
    return styles


def _fallback_scopes(gm, chosen, fixed, gathered, tp) -> set[str]:
    """The modules of ``chosen``'s rows whose pairs, propagated with ``fixed``, need a gather inside them."""
    weights = {}
    for op, st in (fixed | _pair_styles(chosen)).items():
        weights.update(style_placements(op, st, tp))
    prop = propagate(gm, weights, gathered)
    scopes = {_parent(row.fqn) for row, _ in chosen}
    return {s for s in scopes if any(_within(node_fqn(f), s) for f in prop.fallbacks)}


def _valid(gm, chosen, fixed, gathered, tp) -> list[tuple[WeightOp, list[WeightOp]]]:
    """``chosen`` less the pairs whose module would need a gather inside it, until none does."""
    while chosen:
        bad = _fallback_scopes(gm, chosen, fixed, gathered, tp)
        if not bad:
            break
        chosen = [pc for pc in chosen if _parent(pc[0].fqn) not in bad]
    return chosen


def _outer_retry(gm, pairs, chosen, fixed, gathered, tp) -> list[tuple[WeightOp, list[WeightOp]]]:
    """For modules left with no pair: the module's outermost row (one no other candidate reads as a column) with the
    largest subset of its nearest columns that splits without a gather, the rest left whole (the greedy choice
    above takes inner pairs first, and drops the outer row whose columns they made rows).  DeepSeek-V3's MLA:
    o_proj with q_b_proj and kv_b_proj, while kv_a_proj_with_mqa (its latent and the rotary key all heads share) and
    q_a_proj (read by a norm over its whole output) stay whole, as Megatron-Core splits MLA.  Modules of one shape
    (the layers of a stack) try each subset together: one propagation per subset, not per layer."""
    from itertools import combinations

    kept = {_parent(row.fqn) for row, _ in chosen}
    inner = {c.node for _, cols in pairs for c in cols}
    outer = [(row, cols) for row, cols in pairs
             if row.node not in inner and _parent(row.fqn) not in kept and len(cols) <= 5]
    groups: dict[tuple, list] = {}
    for row, cols in outer:
        scope = _parent(row.fqn)
        key = (row.fqn[len(scope):], tuple(c.fqn[len(scope):] for c in cols))
        groups.setdefault(key, []).append((row, cols))
    found = []
    for members in groups.values():
        count = len(members[0][1])
        subsets = [s for k in range(count, 0, -1) for s in combinations(range(count), k)]
        for subset in subsets:
            trial = [(row, [cols[i] for i in subset]) for row, cols in members]
            bad = _fallback_scopes(gm, chosen + found + trial, fixed, gathered, tp)
            good = [pc for pc in trial if _parent(pc[0].fqn) not in bad]
            if good:
                found += good
                members = [pc for pc in members if _parent(pc[0].fqn) in bad]
            if not members:
                break
    return found


def _named(fqn: str, named: set[str]) -> bool:
    """Whether a plan names ``fqn`` or a module that holds it."""
    parts = fqn.split(".")
    return any(".".join(parts[:i]) in named for i in range(len(parts) + 1))


def auto_plan(gm: fx.GraphModule, ops: list[WeightOp], params: set[fx.Node], user_inputs: set[fx.Node],
              tp: int, named: set[str] = frozenset(), fixed: dict[WeightOp, Style] | None = None) -> ResolvedPlan:
    """Choose styles for every splittable module; see the module docstring for the rules.  ``named``: modules a
    plan styles (left to it, with every pair that has a Linear within them); ``fixed``: those styles, propagated
    with the candidates when they are validated."""
    plan = ResolvedPlan(source="auto")
    fixed = fixed or {}
    gathered = {op.node: Replicate() for op, st in fixed.items() if st.gather_output}
    # a Linear over a number of rows the data decides (the tokens routed to one expert by a Python loop): split,
    # its collectives would carry that size, which no rank can know before it runs; it stays whole
    ops = [op for op in ops if not data_sized(op.node)]
    pairs = [(row, cols) for row, cols in _row_candidates(gm, ops, params)
             if not _named(row.fqn, named) and not any(_named(c.fqn, named) for c in cols)]
    role: dict[fx.Node, str] = {}
    chosen = []
    for row, cols in pairs:
        # a row-parallel Linear's output is whole again (all-reduced): a later Linear reading it and a column's
        # output pairs with the column only (Mamba-1's out_proj reads in_proj's x and z and x_proj's dt, B and C)
        cols = [c for c in cols if role.get(c.node) != "row"]
        if role.get(row.node) == "col" or not cols:
            continue
        role[row.node] = "row"
        role.update({c.node: "col" for c in cols})
        chosen.append((row, cols))

    chosen = _valid(gm, chosen, fixed, gathered, tp)
    chosen = _valid(gm, chosen + _outer_retry(gm, pairs, chosen, fixed, gathered, tp), fixed, gathered, tp)
    styles = _pair_styles(chosen)

    paired = {op.node for op in styles}
    weight_nodes = {op.node for op in ops}
    heads = [op for op in ops if op.kind != "embedding" and op.node not in paired and not _named(op.fqn, named)
             and _reaches_output(gm, op, weight_nodes)
             and op.node.meta["val"].shape[-1] % tp == 0]
    for op in heads:
        styles[op] = colwise(gather_output=True)
    head_weights = {op.weight for op in heads} | {op.weight for op, st in fixed.items() if st.kind == "colwise"}
    for op in ops:
        if op.kind != "embedding" or op.node in paired or _named(op.fqn, named):
            continue
        vocab = op.weight.meta["val"].shape[0]
        tied_elsewhere = any(o.weight is op.weight and o is not op for o in ops)
        if vocab % tp == 0 and _from_user_input(op.node.args[1], user_inputs) and (
            not tied_elsewhere or op.weight in head_weights
        ):
            styles[op] = vocab_parallel()
    for op, st in styles.items():
        plan.styles[op.fqn] = st
        plan.sources[op.fqn] = "auto"
    return plan
