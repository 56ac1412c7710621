"""What each pass relies on and what it leaves true, checked by the driver around every pass.

As in torch.fx's ``PassBase``, a pass states what it ``requires`` and ``ensures``; here both are
:class:`Fact` s, named properties of the graph and its ``NodeSpec`` s with a cheap check, so the
driver (``fxshard/compiler.py``) can hold every pass to them:

* before anything runs, a pass list whose order leaves a requirement unmet is refused, naming the
  pass and the fact (:func:`check_order`);
* after each pass, what it ensures and everything earlier passes ensured must hold on the graph
  (:func:`check_facts`).  So a pass finds its requirements true when it starts, and a pass that breaks
  one (inserts a node with no placements, or with no stage after the cut) is named, not the pass that
  would have tripped over it later or the rank file that would have come out wrong.

A pass's contract is its entry in the registry, ``fxshard.passes.PASSES`` (a :class:`Pass`, with the gates that say
when it runs)::

    Pass(collectives_pass, requires=(PLACED,), ensures=(COMMUNICATED,))

A fact a gated pass ensures holds without it where its gate is closed (no cp split at ``--cp 1``), so a later pass
may require it whatever the layout.  A broken contract is fxshard's own bug, never the user's:
:class:`ContractError` is an ``AssertionError``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.graph import loss_cone
from fxshard.ir.blocks import block_units, bodies, held_state, unit_of
from fxshard.ir.comm import FUSED_NAMES
from fxshard.ir.context import CompileContext, spec
from fxshard.ir.cut import under
from fxshard.ir.layout import Layout
from fxshard.ir.sharding import argument, tensor_args
from fxshard.runtime import loss as rt_loss

aten = torch.ops.aten


class ContractError(AssertionError):
    """A pass list out of order, or a pass that leaves a fact it ensures (or an earlier pass ensured) untrue."""


@dataclass(frozen=True)
class Fact:
    """A property of the program one pass establishes and later passes rely on.  ``broken`` returns where it
    fails (a node and what is wrong with it), or None where it holds."""

    name: str
    broken: Callable[[fx.GraphModule, CompileContext], str | None]

    def __str__(self) -> str:
        return repr(self.name)


@dataclass(frozen=True)
class Pass:
    """One entry of the pass registry (``fxshard.passes.PASSES``): the pass, its contract and when it runs.

    ``layout_gate``: the layouts that ask for it (``--ep``: ``lambda layout: layout.ep > 1``); ``program_gate``: the
    programs that hold what it acts on (a router loss), judged on the program as the passes before it left it.
    A pass whose gate says no is not run, nor named in the rank files' headers.  None: every layout, every program.
    """

    run: Callable[[fx.GraphModule, CompileContext], fx.GraphModule]
    requires: tuple[Fact, ...] = ()
    ensures: tuple[Fact, ...] = ()
    layout_gate: Callable[[Layout], bool] | None = None
    program_gate: Callable[[CompileContext], bool] | None = None

    @property
    def name(self) -> str:
        """What ``ctx.passes_run`` and the rank files' headers call it: ``tensor_parallel``."""
        return self.run.__name__.removesuffix("_pass")

    def applies(self, ctx: CompileContext) -> bool:
        return ((self.layout_gate is None or self.layout_gate(ctx.layout))
                and (self.program_gate is None or self.program_gate(ctx)))


def check_order(passes: Sequence[Pass], final: Sequence[Fact], final_name: str = "codegen") -> None:
    """Refuse ``passes`` if one requires a fact no pass before it ensures, or ``final_name`` (what reads the
    passes' result) requires one no pass ensures."""
    for p in passes:
        if not isinstance(p, Pass):
            name = getattr(p, "__name__", repr(p))
            raise ContractError(f"{name} is not a registry entry; add it to fxshard.passes.PASSES as "
                                f"Pass({name}, requires=(...), ensures=(...))")
    ensured: dict[Fact, str] = {}
    steps = [(p.run.__name__, p.requires, p.ensures) for p in passes] + [(final_name, tuple(final), ())]
    for i, (name, requires, _) in enumerate(steps):
        for fact in requires:
            if fact in ensured:
                continue
            later = [n for n, _, ensures in steps[i + 1:] if fact in ensures]
            where = f"{later[0]} ensures it, later in the list" if later else "no pass in the list ensures it"
            raise ContractError(f"{name} requires {fact}, which no pass before it ensures ({where})")
        ensured.update((fact, name) for fact in steps[i][2])


def check_facts(gm: fx.GraphModule, ctx: CompileContext, name: str, ensures: Sequence[Fact],
                earlier: dict[Fact, str]) -> None:
    """After pass ``name``: each fact it ``ensures`` holds, and each fact an ``earlier`` pass (fact -> pass)
    ensured still holds."""
    for fact in ensures:
        where = fact.broken(gm, ctx)
        if where is not None:
            raise ContractError(f"{name} ensures {fact}, but after it {where}")
    for fact, by in earlier.items():
        where = fact.broken(gm, ctx) if fact not in ensures else None
        if where is not None:
            raise ContractError(f"{name} breaks {fact}, which {by} ensured: after it {where}")


# ---------------------------------------------------------------- the facts

def _unplaced(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    for node in gm.graph.nodes:
        if "fxshard" not in node.meta:
            return f"{node.name} has no NodeSpec"
        s = spec(node)
        if node.op not in ("call_function", "output") or s.collective:
            continue  # inserted communication takes its input as it is
        if s.inputs is None:
            return f"{node.name} records no placements for its inputs"
        if len(s.inputs) != len(tensor_args(node)):
            return f"{node.name} records {len(s.inputs)} input placements for {len(tensor_args(node))} tensor inputs"
    return None


def _uncommunicated(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    for node in gm.graph.nodes:
        for arg, need in zip(tensor_args(node), spec(node).inputs or (), strict=False):
            if spec(arg).placement != need:
                return f"{node.name} needs {arg.name} as {need} but it is {spec(arg).placement}"
    return None


_TORCH_DROPOUT = (aten.dropout.default, aten.dropout_.default)


def _torch_dropout(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target in _TORCH_DROPOUT), None)
    return None if node is None else f"{node.name} is still {node.target}"


def _unstaged(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    staged = [n for n in gm.graph.nodes if spec(n).stage is not None]
    if ctx.layout.pp == 1:
        return f"{staged[0].name} has a stage at pp 1" if staged else None
    if ctx.pipeline is None:
        return "no cut is recorded (ctx.pipeline)"
    live = loss_cone(gm)
    last = 0
    for node in gm.graph.nodes:
        stage = spec(node).stage
        if node.op == "call_function" and node in live and stage is None:
            return f"{node.name} computes the loss but has no stage"
        if stage is None:
            continue
        if node not in live or node.op != "call_function":
            return f"{node.name} has stage {stage} but computes no part of the loss"
        if stage < last:
            return f"{node.name} runs in stage {stage} after a node of stage {last}: stages are runs in graph order"
        last = stage
    found = sorted({spec(n).stage for n in staged})
    if found != list(range(ctx.layout.num_stages)):
        return f"the nodes have stages {found}, not each of 0 .. {ctx.layout.num_stages - 1}"
    return None


PLACED = Fact("tensor-parallel placements decided: every node has a NodeSpec, every op the placements of its "
              "inputs", _unplaced)
COMMUNICATED = Fact("collectives inserted: every op's inputs have the placements it needs", _uncommunicated)
MASKS_INVARIANT = Fact("dropout rewritten: no torch dropout left, every mask layout-invariant", _torch_dropout)


def _rows_split(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    rows = ctx.rows
    if rows is None or ctx.layout.dp == 1 or ctx.microbatches > 1:
        return None  # nothing split, or refused (microbatches) by the pass that ensures it
    names = set(rows.whole)
    mixed = next((name for name in rows.mixing if name not in names), None)
    return None if mixed is None else f"{mixed} mixes the batch's rows but is not computed on the whole batch"


ROWS_WHOLE = Fact("ops mixing the batch's rows computed on the whole batch under --dp (ctx.rows.whole names them)",
                  _rows_split)
STAGED = Fact("pipeline stages assigned: at pp > 1 every node computing the loss has its stage, in graph order",
              _unstaged)


def _unblocked(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    for body in bodies(gm, ctx):
        seen: set[str] = set()
        current = ""
        for node in body.nodes:
            block = "" if node in body.apart else spec(node).block
            if block and not under(spec(node).fqn, block):
                return f"{node.name} ({spec(node).fqn or 'the model'}) runs in block {block}, outside its module"
            if block and block != current and block in seen:
                return f"{node.name} runs in block {block}, apart from the block's other nodes"
            seen.add(block)
            current = block
    return None


BLOCKED = Fact("repeated blocks recorded: the nodes of each block a class calls as a submodule are one contiguous run "
               "of its nodes, all inside the block", _unblocked)


def _unfused(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    for body in bodies(gm, ctx):
        units = block_units(body.nodes, body.state, body.keep, body.apart)
        where, held = unit_of(units), held_state(body, units)
        members = set(body.nodes) - body.apart
        for node in body.nodes:
            if spec(node).collective not in FUSED_NAMES:
                continue
            cls = where.get(node)
            odd = next((u for u in node.users if u.target is not operator.getitem or u not in members
                        or where.get(u) is not cls), None)
            if odd is not None:
                return f"{odd.name} reads {node.name} other than as one of its outputs in its class"
            read = node.kwargs["weights"] + node.kwargs["biases"]
            foreign = [a.name for a in read if a is not None and a not in held[cls]]
            if foreign:
                return f"{node.name} reads {', '.join(foreign)}, which its class does not hold"
    return None


OVERLAPPED = Fact("copy_to fused with its column-parallel linears (under --sp, the linears reading a gather_to): "
                  "each rt.copy_to_linears and rt.(fp8_)linears_regathered read by index in its own class, which "
                  "holds its weights and biases", _unfused)


# ---------------------------------------------------------------- what the passes before the placements leave
# Each changes the global program the tensor-parallel pass then places (and the cp split reads the first two), so
# each ensures a fact that pass requires: a wrong order is refused by name, not by a comment.

def _stray_token_means(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    means = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is rt_loss.token_mean]
    if means and ctx.token_count is None:
        return f"{means[0].name} divides by the step's count of targets, but no count is recorded (ctx.token_count)"
    if not means and ctx.token_count is not None:
        return "a count of targets is recorded (ctx.token_count), but no rt.token_mean divides by it"
    terms = sorted(n.kwargs.get("term", 0) for n in means)
    if terms != list(range(len(means))):
        return f"the rt.token_mean terms are {terms}, not each of 0 .. {len(means) - 1} once"
    return None


def _causal_with_mask(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target is _SDPA
                 and argument(n, "is_causal") and argument(n, "attn_mask") is not None), None)
    return None if node is None else f"{node.name} is called with is_causal=True and a mask"


def _unsplit_sequence(gm: fx.GraphModule, ctx: CompileContext) -> str | None:
    split = next((n for n in gm.graph.nodes if spec(n).seq is not None), None)
    if ctx.layout.cp == 1:
        return None if split is None else f"{split.name} has a placement over cp at --cp 1"
    if ctx.sequence is None:
        return "no sequence dimensions are recorded (ctx.sequence)"
    return "no node records its placement over cp (NodeSpec.seq)" if split is None else None


_SDPA = aten.scaled_dot_product_attention.default
TOKEN_MEANS = Fact("token means made whole-step: each rt.token_mean term divides by a count the step records "
                   "(ctx.token_count)", _stray_token_means)
CAUSAL_MASKS = Fact("causal masks proven: an attention whose mask is the causal triangle is called with "
                    "is_causal=True and no mask", _causal_with_mask)
SEQUENCE_SPLIT = Fact("the sequence split over cp: at --cp > 1 the program computes the tokens of one cp rank, the "
                      "nodes holding them placed over cp (NodeSpec.seq)", _unsplit_sequence)
