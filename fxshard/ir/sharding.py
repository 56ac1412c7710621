"""Placement propagation over the tensor-parallel axis: one rule per ATen op family.

Given the placements of the weights (from the plan), walk the graph in order and decide for every
node the placement of its output and the placement each tensor input must have.  Where an input's
placement differs from what the rule needs, the collectives pass inserts the redistribution.  An
op without a rule runs replicated: its sharded inputs are gathered first (always correct, noted in
``Propagation.fallbacks`` so the plan can be improved).

This is analysis only; ``passes/tensor_parallel.py`` applies it.  Rules see global shapes
(``node.meta["val"]``) and never look at the other ranks.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxshard.errors import ShardingError
from fxshard.graph import static_shape
from fxshard.ir.experts import grouped_mm_ops
from fxshard.ir.placement import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
R = Replicate()


@dataclass
class Decision:
    """What one node computes under tensor parallelism."""

    out: Placement | tuple[Placement, ...]
    inputs: tuple[Placement, ...]  # required placement of each tensor input, in ``tensor_args`` order
    rewrite: str | None = None  # "vocab_embedding" | "bias_after_reduce" | "vocab_cross_entropy"


@dataclass
class Propagation:
    decisions: dict[fx.Node, Decision] = field(default_factory=dict)
    fallbacks: list[fx.Node] = field(default_factory=list)
    # sequence parallelism: the nodes whose split output is split over tokens (a reduce-scatter's, and what is
    # computed from it token by token), as opposed to split over a weight's dimension
    sequence: set[fx.Node] = field(default_factory=set)

    def placement(self, node: fx.Node) -> Placement:
        out = self.decisions[node].out
        assert not isinstance(out, tuple), node
        return out


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued fx.Node arguments of ``node``, in argument order (lists flattened)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) if _is_tensor(a) else None)
    return found


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def shape(n: fx.Node) -> tuple[int, ...]:
    return static_shape(n.meta["val"])


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def argument(node: fx.Node, name: str, default=None):
    """The value of the schema argument ``name`` of an ATen call, however it was passed (positional, keyword,
    or left to the schema's default); ``default`` if the op has no such argument.  Rules read every argument
    through this, so a keyword-passed ``dim`` is honored as a positional one."""
    schema = getattr(node.target, "_schema", None)
    arguments = {a.name: (i, a) for i, a in enumerate(schema.arguments)} if schema is not None else {}
    if name not in arguments:
        return default
    i, arg = arguments[name]
    if i < len(node.args) and not arg.kwarg_only:
        return node.args[i]
    return node.kwargs.get(name, arg.default_value if arg.has_default_value() else default)


def set_argument(node: fx.Node, name: str, value) -> None:
    """Set the schema argument ``name`` of an ATen call where it was passed: positionally, else by keyword."""
    arguments = node.target._schema.arguments
    i = next(k for k, a in enumerate(arguments) if a.name == name)
    if i < len(node.args) and not arguments[i].kwarg_only:
        node.update_arg(i, value)
    else:
        node.update_kwarg(name, value)


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor arguments an op writes in place (``add_``'s self, ``embedding_renorm_``'s weight)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    found = []
    for a in schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            value = argument(node, a.name)
            found += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
    return found


def propagate(
    gm: fx.GraphModule,
    weights: dict[fx.Node, Placement],
    forced: dict[fx.Node, Placement] | None = None,
    sequence: int | None = None,
    linear: frozenset[fx.Node] | set[fx.Node] = frozenset(),
) -> Propagation:
    """Decide placements for every node, given placements of parameter placeholders.

    ``forced`` makes consumers of some nodes see another placement (a ``gather_output`` head computes
    S(-1) and its consumers see R): the collectives pass then inserts the redistribution before the
    consumers.  ``sequence``: the tp degree under sequence parallelism (:func:`sequence_decision`), else None.
    ``linear``: nodes known to be linear in their one partial-sum input (an experts module's combine,
    :func:`fxshard.ir.experts.combine_chain`), which pass partial sums on (:func:`_partial_through`); no
    other node does, so no other model's reductions move.
    """
    prop = Propagation()
    forced = forced or {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            prop.decisions[node] = Decision(weights.get(node, R), ())
            continue
        if node.op == "output":
            args = tensor_args(node)
            prop.decisions[node] = Decision(R, tuple(R for _ in args))
            continue
        if node.op != "call_function":
            prop.decisions[node] = Decision(R, ())
            continue
        args = tensor_args(node)
        if node.target is operator.getitem:
            src = prop.decisions[node.args[0]].out
            prop.decisions[node] = Decision(src[node.args[1]] if isinstance(src, tuple) else src, ())
            if node.args[0] in prop.sequence and isinstance(prop.decisions[node].out, Shard):
                prop.sequence.add(node)
            continue
        placements = [forced.get(a, prop.decisions[a].out) for a in args]
        if all(p == R for p in placements):
            decision = Decision(_replicated_out(node), tuple(R for _ in args))
        else:
            decision = _partial_through(placements) if node in linear else None
            decision = decision or _rule(node, args, placements)
            if sequence is not None:
                decision = sequence_decision(node, args, placements, decision, prop, sequence)
            if decision is None and any(isinstance(p, Partial) for p in placements):
                # a partial sum is reduced before use: ask the rule again with it whole, so a split operand
                # beside it stays split (OLMo2's first q/k/v read the vocab-parallel lookup directly; gathering
                # their weights computed that layer unlike the others)
                whole = [R if isinstance(p, Partial) else p for p in placements]
                decision = _rule(node, args, whole) if any(p != R for p in whole) else None
            if decision is None:
                if any(isinstance(p, Shard) for p in placements):
                    prop.fallbacks.append(node)  # partial sums are reduced first: expected, not a fallback
                decision = Decision(_replicated_out(node), tuple(R for _ in args))
            decision = _in_place(node, args, placements, decision, prop)
        prop.decisions[node] = decision
    return prop


def _partial_through(placements: list[Placement]) -> Decision | None:
    """A node linear in its one partial-sum input, every other input the same on every rank (a routing weight,
    an index): summing its results over the ranks sums its inputs first, so its result is a partial sum too.
    The collectives pass gives the replicated inputs that need a gradient a ``copy_to``, whose backward sums
    their gradient over tp (each rank's is computed from its own partial sums)."""
    if sum(isinstance(p, Partial) for p in placements) != 1 or any(p != R for p in placements
                                                                   if not isinstance(p, Partial)):
        return None
    return Decision(Partial(), tuple(placements))


def sequence_dim(node: fx.Node) -> int | None:
    """The token dimension of an activation: the one before the hidden size of ``[B, S, H]`` (any value of 3 or
    more dimensions: ``[B, S, H]``, ``[S, B, H]``, ``[B, C, S, H]``); None for fewer."""
    n = len(shape(node))
    return n - 2 if n >= 3 else None


def sequence_decision(node: fx.Node, args: list[fx.Node], placements: list[Placement], decision: Decision | None,
                      prop: Propagation, tp: int) -> Decision | None:
    """Sequence parallelism as placements (Megatron-LM's, Korthikanti et al. 2022): a partial sum (row-parallel
    output, vocab-parallel lookup) whose consumer a rule can compute split over tokens is reduce-scattered
    along its token dimension instead of all-reduced, and what follows stays split over tokens as long as the
    rules accept it (norms over the hidden size, elementwise ops, dropout, residual adds: each a rule that is
    exact on any split); a consumer no rule computes on the token split (a column-parallel layer, attention)
    gets the value gathered.  Records in ``prop.sequence`` which outputs are split over tokens."""
    if decision is None and any(isinstance(p, Partial) for p in placements):
        tokens = [_token_split(a, p, tp, node) if isinstance(p, Partial) else p
                  for a, p in zip(args, placements, strict=True)]
        if tokens != placements:
            decision = _rule(node, args, tokens)
    if decision is None and any(a in prop.sequence and isinstance(p, Shard)
                                for a, p in zip(args, placements, strict=True)):
        whole = [R if a in prop.sequence or isinstance(p, Partial) else p
                 for a, p in zip(args, placements, strict=True)]
        decision = _rule(node, args, whole) if any(p != R for p in whole) else None
        if decision is None and all(p == R for p in whole):  # the token split gathered, partial sums reduced
            decision = Decision(_replicated_out(node), tuple(R for _ in args))
    if decision is not None and any(isinstance(need, Shard) and (a in prop.sequence or isinstance(p, Partial))
                                    for a, p, need in zip(args, placements, decision.inputs, strict=True)):
        outs = decision.out if isinstance(decision.out, tuple) else (decision.out,)
        if any(isinstance(o, Shard) for o in outs):
            prop.sequence.add(node)
    return decision


def _token_split(node: fx.Node, p: Partial, tp: int, consumer: fx.Node) -> Placement:
    """The split over tokens a partial sum is reduce-scattered to, checked: the token count must divide.

    A ``[B*S, H]`` partial sum that ``consumer`` views as ``[B, S, H]`` (GPT-2's ``Conv1D`` multiplies
    flattened tokens) is split as that view's sequence: each of its B blocks of S rows split, ``S(0)xB``."""
    dim, blocks = sequence_dim(node), 1
    if dim is None and len(shape(node)) == 2 and consumer.target in _RESHAPES:
        out = shape(consumer)
        if len(out) >= 3 and out[-1] == shape(node)[1] and math.prod(out[:-1]) == shape(node)[0]:
            dim, blocks = 0, shape(node)[0] // out[-2]
    if dim is None:
        return p
    size = shape(node)[dim] // blocks
    if size % tp:
        from fxshard.graph import node_fqn

        raise ShardingError(
            f"{node_fqn(node) or 'model'}: --sp splits its output {list(shape(node))} over tp={tp} along dimension "
            f"{dim}, the sequence ({size} tokens{f' in each of {blocks} blocks' if blocks > 1 else ''}), which {tp} "
            f"does not divide; use a sequence length divisible by "
            f"{tp} (pad the batch), another --tp, or drop --sp")
    return Shard(dim, blocks)


def _in_place(node: fx.Node, args: list[fx.Node], placements: list[Placement], decision: Decision,
              prop: Propagation) -> Decision:
    """An op that writes an input in place must write the tensor itself, never a redistributed copy (the
    write would land on the copy and later readers of the input would not see it).  A replicated written
    input keeps the op whole (its other inputs are gathered); a split one that the rule would move is
    refused."""
    written = written_inputs(node)
    moved = [a for a in written for i, b in enumerate(args) if b is a and decision.inputs[i] != placements[i]]
    if not moved:
        return decision
    if all(placements[args.index(a)] == R for a in written):
        if any(isinstance(p, Shard) for p in placements) and node not in prop.fallbacks:
            prop.fallbacks.append(node)
        return Decision(_replicated_out(node), tuple(R for _ in args))
    functional = functional_form(node)
    if functional is not None:  # nothing reads the written value again but through this op: write a new value
        node.target = functional
        return decision
    from fxshard.graph import node_fqn

    a = moved[0]
    hint = (" (nn.Embedding's max_norm renormalizes the looked-up rows of the weight in place: give this "
            "embedding replicate() in the plan, or drop max_norm)" if node.target is aten.embedding_renorm_.default
            else "")
    raise ShardingError(
        f"{node_fqn(node) or 'model'}: {node.target} writes {a.name} in place, which is split over tp "
        f"({placements[args.index(a)]}); no sharding rule computes this op on the split, and gathering it would "
        f"update a copy, not the tensor{hint}. Replicate the weights this value is computed from, or make the "
        "update out of place")


def functional_form(node: fx.Node):
    """The out-of-place overload of an in-place op (``aten.add.Tensor`` for ``aten.add_.Tensor``) when nothing can
    see the write but through the op's result: it writes one value computed in the forward (not an input, a
    parameter or a buffer, nor a view of another value) that no op reads after it, directly or through a view.
    ``x.add_(shared)`` onto a row-parallel output (P(sum)) then becomes ``x + shared``, which the rule table
    computes on the split (its partial sums reduced first).  None otherwise."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target.overloadpacket.__name__
    written = written_inputs(node)
    if not name.endswith("_") or name.startswith("_") or len(written) != 1 or written[0] is not node.args[0]:
        return None
    functional = getattr(getattr(torch.ops.aten, name[:-1], None), target._overloadname, None)
    x = written[0]
    if functional is None or x.op != "call_function" or _aliases(x):
        return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    for user in x.users:
        if user is not node and (order[user] > order[node] or _aliases(user)):
            return None
    return functional


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s value may share memory with an input (a view, or an op writing in place)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.target is not operator.getitem
    return any(r.alias_info is not None for r in schema.returns)


def _replicated_out(node: fx.Node):
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(R for _ in val)
    return R


# ---------------------------------------------------------------- rules

_RULES: dict = {}


def rule_decision(node: fx.Node, args: list[fx.Node], placements: list[Placement]) -> Decision | None:
    """The table's decision for ``node`` with its tensor inputs at ``placements`` (None: no rule computes it so).
    Rules are axis-free; context parallelism asks them about its own axis (:mod:`fxshard.ir.cp_rules`)."""
    return _rule(node, args, placements)


def _rule(node, args, placements) -> Decision | None:
    packet = getattr(node.target, "overloadpacket", None)
    fn = _RULES.get(node.target) or _RULES.get(packet)
    if fn is None and node.target in grouped_mm_ops():  # transformers' op exists once transformers registered it
        fn = _grouped_mm
    if fn is None and isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        fn = _pointwise
    if fn is None:
        return None
    if not getattr(fn, "general", False):  # a rule written for ordinary splits sees the others gathered
        placements = [R if isinstance(p, Shard) and p.general else p for p in placements]
        if all(p == R for p in placements):
            return None
    return fn(node, args, placements)


def rule(*ops, general: bool = False):
    """Register a rule for ``ops``.  ``general``: the rule handles splits of unequal blocks and parts held by
    several ranks (``Shard.sizes``, ``Shard.parts``) itself; any other rule sees such inputs as replicated,
    so the collectives pass gathers them first (always correct)."""
    def register(fn):
        fn.general = general
        for op in ops:
            _RULES[op] = fn
        return fn

    return register


def common_split(splits: list[Shard]) -> Shard | None:
    """The one split several operands agree on, or None: equal splits agree; a split whose parts several ranks
    hold alike (``S(d)/g``) yields to the ordinary split of the same dimension, which each rank cuts its share
    from (``rt.own_part``): the ordinary split proves the size divides over every rank."""
    found = set(splits)
    if len(found) > 1:
        plain = {p for p in found if not p.general}
        if len(plain) == 1 and all(p.blocks == 1 and not p.sizes and p.dim == next(iter(plain)).dim for p in found):
            return plain.pop()
        return None
    return found.pop() if found else None


def _aligned(s: tuple[int, ...], p: Placement, out: Shard, n: int) -> Placement:
    """The placement an operand of shape ``s`` placed ``p`` needs beside an ``n``-d result split as ``out``,
    broadcasting as torch does: its own split as it is (an ``S(d)/g`` beside an ordinary split of the same
    dimension: that split, :func:`common_split`); whole where it has no such dimension or broadcasts along it
    (size 1); else split alike.  A partial sum is reduced first: summing the result over the ranks would sum
    every other operand's contribution too."""
    ad = out.dim - (n - len(s))
    if isinstance(p, Shard):
        return out.moved(p.dim) if p != out.moved(p.dim) and p.parts and not out.general else p
    return R if ad < 0 or s[ad] == 1 else out.moved(ad)


@rule(aten.type_as, general=True)
def _type_as(node, args, placements):
    """``x.type_as(other)``: ``x`` cast to ``other``'s dtype, element by element; ``other`` is read for its dtype
    alone, whatever its shape and placement (Funnel's ``attention_mask.type_as(inputs_embeds)``: a ``[B, S]`` mask
    beside ``[B, S, H]`` embeddings, both split along the batch)."""
    if isinstance(placements[0], Partial):  # a cast of a partial sum rounds each part: not the sum's cast
        return None
    return Decision(placements[0], tuple(placements))


@rule(aten.dropout, aten.clone, aten.contiguous, aten.detach, aten.to, aten._to_copy,
      aten.masked_fill, aten.where, aten.lift_fresh_copy, aten.gelu, aten.silu, aten.relu, aten.tanh,
      aten.sigmoid, aten.copy_, general=True)
def _pointwise(node, args, placements):
    out_shape = shape(node)
    n = len(out_shape)
    sharded = []
    for a, p in zip(args, placements, strict=True):
        if isinstance(p, Partial):
            return None
        if isinstance(p, Shard):
            s = shape(a)
            od = p.dim + n - len(s)
            if s[p.dim] != out_shape[od]:
                return None
            sharded.append(p.moved(od))
    out = common_split(sharded)
    if out is None:
        return None
    if out.general and node.target.overloadpacket is aten.dropout:
        return None  # its mask is drawn by position (passes/dropout.py): on an ordinary split only
    need = tuple(_aligned(shape(a), p, out, n) for a, p in zip(args, placements, strict=True))
    return Decision(out, need)


_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@rule(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, general=True)
def _reshape(node, args, placements):
    (p,) = placements[:1]
    if not isinstance(p, Shard):
        return None
    src, dst = shape(args[0]), shape(node)
    if p.general:
        return _general_reshape(src, dst, p)
    blocked = _blocked_reshape(src, dst, p)
    if blocked is not None:
        return Decision(blocked, (p,))
    out = reshape_dim(src, dst, p.dim)
    if out is None or (p.blocks > 1 and src[p.dim] != dst[out]):
        return None
    return Decision(Shard(out, p.blocks), (p,))


def _general_reshape(src: tuple[int, ...], dst: tuple[int, ...], p: Shard) -> Decision | None:
    """A reshape of a split of unequal blocks keeps it where the split dimension stays as it is.  One block cut into
    g parts (``S(d)/g``) lands where the elements before the split dimension end, on the first dimension there
    that g divides past dimensions of 1: ``[.., 2 * 16] -> [.., 2, 16]`` cut into 2 or into 1 part lands on the 2
    (:func:`reshape_dim` would put a whole part on the 16), ``[.., kv, n, ..] -> [.., kv * n, ..]`` on the
    merged heads."""
    out = reshape_dim(src, dst, p.dim)
    if p.blocks > 1 or p.sizes:
        return Decision(p.moved(out), (p,)) if out is not None and src[p.dim] == dst[out] else None
    g = p.parts[0]
    outer = math.prod(src[:p.dim])  # the elements before the split dimension are the same before its new place
    j = next((j for j in range(len(dst) + 1) if math.prod(dst[:j]) == outer), None)
    while j is not None and j < len(dst) and dst[j] % g:
        j = j + 1 if dst[j] == 1 else None
    return Decision(p.moved(j), (p,)) if j is not None and j < len(dst) and src[p.dim] % g == 0 else None


def _blocked_reshape(src: tuple[int, ...], dst: tuple[int, ...], p: Shard) -> Shard | None:
    """A split of the second of two dimensions that the reshape merges is the merged dimension split in blocks
    (``[B, S, H]`` split on S viewed as ``[B*S, H]``: each of its B blocks of S rows split, ``S(0)xB``), and
    back: the same elements, in the same order, on each rank.  None for any other reshape."""
    d = p.dim
    if p.blocks == 1 and d >= 1 and len(dst) == len(src) - 1 and src[:d - 1] == dst[:d - 1] \
            and dst[d - 1] == src[d - 1] * src[d] and src[d + 1:] == dst[d:] and src[d - 1] > 1:
        return Shard(d - 1, src[d - 1])
    if p.blocks > 1 and len(dst) == len(src) + 1 and src[:d] == dst[:d] and dst[d] == p.blocks \
            and src[d] == dst[d] * dst[d + 1] and src[d + 1:] == dst[d + 2:]:
        return Shard(d + 1)
    return None


def reshape_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """Where a split of ``src`` along ``dim`` lands after reshaping to ``dst``.

    Dimensions are grouped where running products agree; the split must be on the first non-unit
    dimension of its group and lands on the first non-unit dimension of the matching group (e.g.
    hidden 512 split over ranks -> heads 8 x head_dim 64 split on heads).  ``None`` if the split
    would not stay contiguous.  Divisibility of the target size is checked by the pass.
    """
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= src[i]
            else:
                j += 1
                gj.append(j)
                pj *= dst[j]
        # absorb trailing unit dims into this group
        while i + 1 < len(src) and src[i + 1] == 1 and not (j + 1 < len(dst) and dst[j + 1] == 1):
            i += 1
            gi.append(i)
        while j + 1 < len(dst) and dst[j + 1] == 1 and not (i + 1 < len(src) and src[i + 1] == 1):
            j += 1
            gj.append(j)
        if dim in gi:
            first_src = next((k for k in gi if src[k] != 1), gi[0])
            if dim != first_src:
                return None
            return next((k for k in gj if dst[k] != 1), gj[0])
        i += 1
        j += 1
    return None


@rule(aten.expand, general=True)
def _expand(node, args, placements):
    p = placements[0]
    if not isinstance(p, Shard):
        return None
    od = p.dim + len(shape(node)) - len(shape(args[0]))
    if shape(args[0])[p.dim] != shape(node)[od]:
        return None
    return Decision(p.moved(od), (p,))


@rule(aten.unsqueeze, general=True)
def _unsqueeze(node, args, placements):
    p = placements[0]
    d = _norm(argument(node, "dim"), len(shape(node)))
    return Decision(p.moved(p.dim + (d <= p.dim)), (p,)) if isinstance(p, Shard) else None


def squeezed_dims(node: fx.Node) -> list[int]:
    """The dimensions a ``squeeze`` removes from its (global) input: those it names, or all, that have size 1.
    A rank's part may have size 1 where the whole does not (a split of size tp): the tensor-parallel pass
    then names these dimensions, so that the rank squeezes what the model squeezes."""
    src = shape(node.args[0])
    dim = argument(node, "dim")
    named = range(len(src)) if dim is None else dim if isinstance(dim, (list, tuple)) else [dim]
    return sorted({_norm(d, len(src)) for d in named if src[_norm(d, len(src))] == 1})


@rule(aten.squeeze, general=True)
def _squeeze(node, args, placements):
    p = placements[0]
    if not isinstance(p, Shard):
        return None
    dims = squeezed_dims(node)
    if p.dim in dims:
        return None
    return Decision(p.moved(p.dim - sum(d < p.dim for d in dims)), (p,))


@rule(aten.transpose, general=True)
def _transpose(node, args, placements):
    p = placements[0]
    if not isinstance(p, Shard):
        return None
    n = len(shape(node))
    a, b = _norm(argument(node, "dim0"), n), _norm(argument(node, "dim1"), n)
    d = b if p.dim == a else a if p.dim == b else p.dim
    return Decision(p.moved(d), (p,))


@rule(aten.t, general=True)
def _t(node, args, placements):
    p = placements[0]
    if not isinstance(p, Shard) or len(shape(node)) < 2:
        return None
    return Decision(p.moved(1 - p.dim), (p,))


@rule(aten.permute, general=True)
def _permute(node, args, placements):
    p = placements[0]
    if not isinstance(p, Shard):
        return None
    n = len(shape(node))
    perm = [_norm(d, n) for d in argument(node, "dims")]
    return Decision(p.moved(perm.index(p.dim)), (p,))


@rule(aten.slice, aten.select, aten.narrow, general=True)
def _slice(node, args, placements):
    p = placements[0]
    if not isinstance(p, Shard):
        return None
    n_in = len(shape(args[0]))
    dim = _norm(argument(node, "dim"), n_in)
    if dim == p.dim:
        return None
    d = p.dim - (1 if node.target.overloadpacket is aten.select and dim < p.dim else 0)
    return Decision(p.moved(d), (p,))


@rule(aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, general=True)
def _split(node, args, placements):
    p = placements[0]
    if not isinstance(p, Shard):
        return None
    val = node.meta["val"]
    n_in = len(shape(args[0]))
    dim = _norm(argument(node, "dim"), n_in)
    if dim != p.dim:
        shift = node.target.overloadpacket is aten.unbind and dim < p.dim
        return Decision(tuple(p.moved(p.dim - shift) for _ in val), (p,))
    if node.target.overloadpacket is aten.unbind:
        return None
    parts = _split_blocks(p, shape(args[0])[dim], [tuple(v.shape)[dim] for v in val])
    return Decision(parts, (p,)) if parts is not None else None


def _split_blocks(p: Shard, size: int, pieces: list[int]) -> tuple[Shard, ...] | None:
    """The splits of the pieces a split along the packed dimension cuts, when each piece is a run of whole blocks
    (``[z, xBC, dt]`` of a Mamba-2 ``in_proj`` packed as z, x, B, C, dt): each piece holds its blocks, the part of
    each on every rank.  None when a piece would cut a block."""
    blocks, out, b = p.block_sizes(size), [], 0
    for piece in pieces:
        first, total = b, 0
        while total < piece and b < len(blocks):
            total, b = total + blocks[b], b + 1
        if total != piece or b == first:
            return None
        out.append(Shard(p.dim, b - first, blocks[first:b] if p.sizes else (),
                         p.parts[first:b] if p.parts else ()))
    return tuple(out) if b == len(blocks) else None


@rule(aten.cat, general=True)
def _cat(node, args, placements):
    n = len(shape(node))
    dim = _norm(argument(node, "dim"), n)
    if any(len(shape(a)) != n for a in args):
        return None
    if not all(isinstance(p, Shard) for p in placements):
        return _cat_beside_whole(dim, placements)
    if placements[0].dim == dim:  # along the split: the pieces' parts packed as blocks, each rank [a_r, b_r, ..]
        if any(p.dim != dim for p in placements):
            return None
        sizes = tuple(s for a, p in zip(args, placements, strict=True) for s in p.block_sizes(shape(a)[dim]))
        parts = tuple(g for p in placements for g in (p.parts or (0,) * p.blocks))
        return Decision(Shard(dim, len(sizes), sizes, parts), tuple(placements))
    if len(set(placements)) != 1:
        return None
    return Decision(placements[0], tuple(placements))


def _cat_beside_whole(dim: int, placements: list[Placement]) -> Decision | None:
    """Whole pieces beside pieces split alike along another dimension than the concatenated one: each rank takes
    its part of the whole ones (a slice; their gradient's parts are gathered back).  GPT-OSS's attention sinks, one
    learned logit per head expanded over the queries, concatenated to the heads' scores before the softmax."""
    shards = {p for p in placements if isinstance(p, Shard)}
    if len(shards) != 1 or any(not isinstance(p, Shard) and p != R for p in placements):
        return None
    split = shards.pop()
    if split.dim == dim or split.general or split.blocks != 1:
        return None
    return Decision(split, tuple(split for _ in placements))


@rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)
def _softmax(node, args, placements):
    p = placements[0]
    dim = _norm(argument(node, "dim"), len(shape(node)))
    if not isinstance(p, Shard) or p.dim == dim:
        return None
    return Decision(p, (p,))


@rule(aten.layer_norm, aten.rms_norm, general=True)
def _norm_layer(node, args, placements):
    p = placements[0]
    if not isinstance(p, Shard) or any(not q == R for q in placements[1:]):
        return None
    n = len(shape(node))
    if p.dim >= n - len(argument(node, "normalized_shape")):
        return None
    return Decision(p, tuple(placements))


@rule(aten.sum, aten.mean, aten.amax, aten.amin, general=True)
def _reduce(node, args, placements):
    """Over other dimensions the split stays.  A sum over the split dimension is each rank's sum of its part, a
    partial sum (a grouped norm's variance when its groups do not divide over tp: the partial sums are
    all-reduced, the norm stays split); a mean is the same divided by tp (rewrite ``mean_of_parts``).  A max
    over the split, or a split of unequal or replicated blocks reduced along itself, declines."""
    p = placements[0]
    dim = argument(node, "dim")
    if not isinstance(p, Shard) or not isinstance(dim, (list, tuple)):  # sum(x), mean(x): every dim
        return None
    n = len(shape(args[0]))
    dims = {_norm(d, n) for d in dim}
    keepdim = argument(node, "keepdim", False)
    if not dims:
        return None
    if p.dim in dims:
        packet = node.target.overloadpacket
        if p.general or p.blocks > 1 or packet not in (aten.sum, aten.mean):
            return None
        return Decision(Partial(), (p,), "mean_of_parts" if packet is aten.mean else None)
    d = p.dim if keepdim else p.dim - sum(x < p.dim for x in dims)
    return Decision(p.moved(d), (p,))


@rule(aten.max, aten.min, general=True)
def _reduce_with_indices(node, args, placements):
    """``x.max(dim)`` / ``x.min(dim)``: values and indices along a dimension other than the split keep the split
    (GPT-OSS subtracts each row's max from its scores and sinks before the softmax).  The overloads over every
    element, or along the split, decline."""
    p = placements[0]
    dim = argument(node, "dim")
    if not isinstance(p, Shard) or not isinstance(dim, int) or len(args) != 1:
        return None
    n = len(shape(args[0]))
    dim = _norm(dim, n)
    if p.dim == dim:
        return None
    out = p if argument(node, "keepdim", False) else p.moved(p.dim - (dim < p.dim))
    return Decision((out, out), (p,))


@rule(aten.linear, general=True)
def _linear(node, args, placements):
    x, w = placements[0], placements[1]
    b = placements[2] if len(args) > 2 else None
    n = len(shape(node))
    if isinstance(w, Shard) and w.dim == 0 and x == R and b in (None, w):
        return Decision(w.moved(n - 1), tuple(placements))
    if any(isinstance(p, Shard) and p.general for p in placements):
        return None
    if isinstance(w, Shard) and w.dim == 1 and w.blocks == 1 and b in (None, R):
        need_x = Shard(len(shape(args[0])) - 1)
        return Decision(Partial(), (need_x, w) + ((R,) if b is not None else ()),
                        "bias_after_reduce" if b is not None else None)
    if w == R and b in (None, R) and isinstance(x, Shard) and x.dim < len(shape(args[0])) - 1:
        return Decision(x, tuple(placements))
    return None


@rule(aten.addmm)
def _addmm(node, args, placements):
    """``beta * b + alpha * (x @ w)``, ``b`` broadcast to ``[N, out]`` (a Conv1D bias ``[out]``, or a full
    ``[N, out]``).  Split columns scale each local part alike; split rows make partial sums, to which the bias
    is added once after the reduction, which only ``beta = alpha = 1`` keeps exact (otherwise declined)."""
    b, x, w = placements
    nb = len(shape(args[0]))
    if isinstance(w, Shard) and w.dim == 1 and x == R and b in (R, Shard(nb - 1, w.blocks)):
        need_b = b if isinstance(b, Shard) or nb == 0 or shape(args[0])[-1] == 1 else Shard(nb - 1, w.blocks)
        return Decision(Shard(1, w.blocks), (need_b, x, w))
    if isinstance(w, Shard) and w.dim == 0 and w.blocks == 1 and b == R:
        if argument(node, "beta", 1) != 1 or argument(node, "alpha", 1) != 1:
            return None
        return Decision(Partial(), (R, Shard(1), w), "bias_after_reduce")
    if w == R and x == Shard(0) and b in (R, Shard(0)):
        need_b = Shard(0) if nb == 2 and shape(args[0])[0] != 1 else R
        return Decision(Shard(0), (need_b, x, w))
    return None


@rule(aten.mm, aten.bmm, aten.matmul)
def _matmul(node, args, placements):
    a, b = placements
    sa, sb = shape(args[0]), shape(args[1])
    if len(sa) < 2 or len(sb) < 2:
        return None
    n = len(shape(node))
    if isinstance(a, Shard) and a.dim == len(sa) - 1 and b == Shard(len(sb) - 2, a.blocks):
        # packed blocks pair up: each rank contracts the same columns of a as rows of b
        return Decision(Partial(), (a, b))
    if isinstance(a, Shard) and a.dim == len(sa) - 2 and b == R:
        return Decision(Shard(n - 2, a.blocks), (a, b))
    if isinstance(b, Shard) and b.dim == len(sb) - 1 and a == R:
        return Decision(Shard(n - 1, b.blocks), (a, b))
    # batch dimensions
    batch = set()
    for s, p in ((sa, a), (sb, b)):
        if isinstance(p, Shard):
            if p.dim >= len(s) - 2:
                return None
            batch.add((p.dim + n - len(s), p.blocks))
    if len(batch) != 1:
        return None
    od, blocks = batch.pop()
    out = Shard(od, blocks)
    return Decision(out, tuple(_aligned(s, p, out, n) for s, p in ((sa, a), (sb, b))))


def _grouped_mm(node, args, placements):
    """Rows sorted by expert ``x [M, K]`` times stacked expert weights ``w [E, K, N]`` at offsets ``offs [E]``
    (a mixture-of-experts layer, :mod:`fxshard.ir.experts`): tensor parallelism inside the experts.  Every
    expert's columns split (``w`` S(2), packed blocks kept) make the rows' columns split; the contraction split
    in both (``x`` S(1), ``w`` S(1)) makes partial sums.  The offsets are the router's, whole on every rank."""
    if len(args) != 3 or len(shape(args[0])) != 2 or len(shape(args[1])) != 3:
        return None  # a bias, or the 3-d x 3-d form without offsets
    x, w, offs = placements
    if offs != R:
        return None
    if x == R and isinstance(w, Shard) and w.dim == 2:
        return Decision(Shard(1, w.blocks), (x, w, offs))
    if isinstance(x, Shard) and x.dim == 1 and w == Shard(1, x.blocks):
        return Decision(Partial(), (x, w, offs))
    return None


@rule(aten.scaled_dot_product_attention, general=True)
def _sdpa(node, args, placements):
    """Attention split by heads.  Key/value heads fewer than tp are cut into as many parts as heads (``S(1)/kv``,
    each held by tp/kv ranks): with ``enable_gqa`` a rank's query heads all read its one key/value head, taken
    as it is; repeated to the query heads first (``repeat_kv``), each rank keeps its share (``rt.own_part``)."""
    q, k, v = placements[:3]
    if not (isinstance(q, Shard) and not q.general and q.dim < len(shape(args[0])) - 2 and q.blocks == 1):
        return None
    if k != v or not isinstance(k, Shard):
        return None
    kept = k  # as the key and value are; one part (the whole head on every rank) reads as a split of the heads
    if k.blocks == 1 and not k.sizes and k.parts == (1,):
        k = k.moved(q.dim)
    if k.moved(q.dim) != k:
        return None
    need_kv = q
    if k.general:
        grouped = argument(node, "enable_gqa", False) and shape(args[1])[q.dim] < shape(args[0])[q.dim]
        if k.blocks > 1 or k.sizes:
            return None
        if grouped and k.parts[0] == shape(args[1])[q.dim]:  # one key/value head per part
            need_kv = kept
        elif shape(args[1])[q.dim] != shape(args[0])[q.dim]:
            return None
    elif k != q:
        return None
    n = len(shape(node))
    masks = [_aligned(shape(a), p, q, n) for a, p in zip(args[3:], placements[3:], strict=True)]
    if any(isinstance(p, Shard) and p != Shard(q.dim - (n - len(shape(a))))
           for a, p in zip(args[3:], masks, strict=True)):
        return None
    return Decision(q, (q, need_kv, need_kv, *masks))


@rule(aten.embedding)
def _embedding(node, args, placements):
    """Split rows (vocab-parallel: a masked lookup whose padding row keeps no gradient), split columns, or
    split ids.  ``scale_grad_by_freq`` counts each id over the whole lookup, and ``sparse`` gradients are not
    what the split lookups produce: both decline (the weight is gathered, the lookup runs whole)."""
    w, ids = placements
    n = len(shape(node))
    if argument(node, "scale_grad_by_freq") or argument(node, "sparse"):
        return None
    if isinstance(w, Shard) and w.dim == 0 and w.blocks == 1 and ids == R:
        return Decision(Partial(), (w, ids), "vocab_embedding")
    if isinstance(w, Shard) and w.dim == 1 and ids == R:
        return Decision(Shard(n - 1, w.blocks), (w, ids))
    if w == R and isinstance(ids, Shard):
        return Decision(ids, (w, ids))
    return None


def vocab_parallel_loss(node: fx.Node) -> bool:
    """Whether this ``cross_entropy_loss`` can run vocab-parallel once its logits are split by class:
    2-d logits ``[N, C]``, integer class targets ``[N]``, no class weights, no label smoothing."""
    if node.target is not aten.cross_entropy_loss.default or len(node.args) < 2:
        return False
    logits, target = node.args[:2]
    weight, smoothing = argument(node, "weight"), argument(node, "label_smoothing")
    t = target.meta.get("val") if isinstance(target, fx.Node) else None
    return (isinstance(logits, fx.Node) and len(shape(logits)) == 2 and isinstance(t, torch.Tensor)
            and t.dim() == 1 and not t.is_floating_point() and weight is None and not smoothing)


@rule(aten.cross_entropy_loss)
def _cross_entropy(node, args, placements):
    """Logits split over the classes (a column-parallel LM head): Megatron's vocab-parallel cross entropy.

    Each rank reduces its own classes to two numbers per token (their logsumexp, and the target's logit
    where this rank holds the target); those are gathered, so the logits themselves are never gathered.
    Class weights, label smoothing and probability targets are not supported: their logits are
    all-gathered first."""
    if not vocab_parallel_loss(node) or len(args) != 2 or placements[0] != Shard(1) or placements[1] != R:
        return None
    return Decision(R, tuple(placements), "vocab_cross_entropy")


@rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.zeros_like, aten.ones_like,
      aten.empty_like, aten.full_like)
def _factory_like(node, args, placements):
    """Only the input's shape is read: a split input makes a split result; anything else (a partial sum, or
    ``new_*`` with its own global size) makes a whole one, without moving the input."""
    if node.target.overloadpacket in (aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like) \
            and isinstance(placements[0], Shard):
        return Decision(placements[0], tuple(placements))
    if node.target.overloadpacket is aten.new_empty and _shaped_like_along(node, args[0], placements[0]):
        return Decision(placements[0], tuple(placements))
    return Decision(R, tuple(placements))


def _shaped_like_along(node, x, p) -> bool:
    """``x.new_empty(size)`` whose size keeps ``x``'s rank and its size along the dimension ``x`` is split on: a
    buffer the model fills by writes (DeepSeek-V3's MLA concatenates each head's key parts into
    ``kv_nope.new_empty(B, H, S, d)`` by ``copy_`` into slices).  Its values are undefined until written, so it may
    be split as ``x`` is (its size made this rank's); every write into it then meets the rules as any value
    split by heads does, and a whole value written into a slice of it is sliced, not gathered."""
    if not isinstance(p, Shard) or p.general or p.blocks != 1 or p.parts:
        return False
    size, full = list(argument(node, "size")), shape(x)
    return len(size) == len(full) and size[p.dim] == full[p.dim]
