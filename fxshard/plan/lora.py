"""Where a LoRA layer's adapters go over tp: they follow their base's split (LoRA is a plan, not a wrapper).

peft turns a linear ``W`` into ``W.base_layer(x) + scaling * W.lora_B.default(W.lora_A.default(dropout(x)))``
(:mod:`fxshard.capture.lora`).  The base is planned as the linear it was, by the model's plan, the user's or
automatic pairing, on a copy of the graph without the adapters (:func:`planning_view`: pairing and the packed
blocks of a fused projection read the graph around the base); then each adapter takes the split that keeps the sum
exact (Megatron-Bridge's and peft's ``LoraParallelLinear``'s):

==============================  =====================================  ===============================
base                            A (``[r, in]``)                        B (``[out, r]``)
==============================  =====================================  ===============================
column-parallel (``S(0)``)      whole (``R``)                          ``S(0)``, the base's blocks
row-parallel (``S(1)``)         ``S(1)``: its output a partial sum      whole (``R``)
whole                           whole                                  whole
==============================  =====================================  ===============================

Under a row-parallel base, A's partial sums (``[tokens, r]``) are all-reduced before B, and the base's own before the
sum (the propagation's choice: a linear whose input is a partial sum reads it whole).  Adding ``B(A_t x_t)`` into the
base's partial sum instead would save that all-reduce only to need another: B's weight gradient would be a partial
sum over tp (``g^T A_t x_t`` on each rank), all-reduced in backward.  The one kept is the smaller on the forward path
alone; under ``--sp`` it becomes a reduce-scatter of ``[tokens, r]``.  GPT-2's ``Conv1D`` base (weight ``[in, out]``)
takes the same splits along its own dimensions, and B the blocks of a packed q/k/v.  A LoRA layer whose adapters no
rule places (an embedding's, a gathered head's, a variant such as DoRA) is refused at tp > 1, naming it::

    plan, weights, forced, roles = plan_lora(gm, ops, layers, params, user_inputs, plan_fn, placements_fn, tp)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.capture.lora import lora_modules
from fxshard.errors import PlanError
from fxshard.graph import node_fqn
from fxshard.ir.placement import Placement, Replicate, Shard
from fxshard.plan.layers import WeightOp
from fxshard.plan.styles import Style, colwise, replicate, rowwise

aten = torch.ops.aten
R = Replicate()
LORA = "lora"  # the plan source of the adapters' entries


@dataclass(frozen=True)
class LoraLayer:
    """One peft LoRA layer in the captured graph: its wrapper ``fqn`` (``W``), the base's op and the adapters' (None
    where peft's adapters are no Linear ops: an embedding's), the sum (``total``, the last node of ``W``) and the base
    output it adds to."""

    fqn: str
    type_name: str
    base: WeightOp | None
    a: WeightOp | None
    b: WeightOp | None
    total: fx.Node | None
    base_out: fx.Node | None

    @property
    def plain(self) -> bool:
        """Vanilla LoRA on a Linear or Conv1D: the form the split rules below are written for."""
        return None not in (self.base, self.a, self.b, self.total, self.base_out) and self.base.kind != "embedding"


def _within(fqn: str, scope: str) -> bool:
    return fqn == scope or fqn.startswith(scope + ".")


def lora_layers(gm: fx.GraphModule, ops: list[WeightOp], model: torch.nn.Module) -> list[LoraLayer]:
    """The LoRA layers of ``model`` that the graph runs, in model order."""
    wrappers = lora_modules(model)
    if not wrappers:
        return []
    last: dict[str, fx.Node] = {}
    sums: dict[str, fx.Node] = {}
    for n in gm.graph.nodes:
        fqn = node_fqn(n)
        if fqn in wrappers:
            last[fqn] = n
            if n.target is aten.add.Tensor and isinstance(n.args[0], fx.Node) \
                    and _within(node_fqn(n.args[0]), fqn + ".base_layer"):
                sums[fqn] = n
    layers = []
    for fqn, module in wrappers.items():
        def op(scope: str) -> WeightOp | None:
            return next((o for o in ops if _within(o.fqn, scope)), None)

        adapters = list(getattr(module, "lora_A", {}))
        name = adapters[0] if len(adapters) == 1 and not getattr(module, "lora_variant", {}) else None
        base = op(fqn + ".base_layer")
        if base is None and fqn not in last:
            continue  # not run by the forward
        add = sums.get(fqn)
        layers.append(LoraLayer(fqn, type(module.base_layer).__name__, base,
                                op(f"{fqn}.lora_A.{name}") if name else None,
                                op(f"{fqn}.lora_B.{name}") if name else None,
                                last.get(fqn), add.args[0] if add is not None else None))
    return layers


def planning_view(gm: fx.GraphModule, layers: list[LoraLayer]) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``gm`` whose LoRA layers are their bases alone (each sum's users read the base output; the adapters'
    ops are gone), and the map of ``gm``'s nodes to the copy's.  ``gm`` is left as it is."""
    graph = fx.Graph()
    vmap: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, vmap)
    graph.output(out)
    for layer in layers:
        vmap[layer.total].replace_all_uses_with(vmap[layer.base_out])
    branch = {vmap[n] for n in gm.graph.nodes if n.op == "call_function"
              for layer in layers if _within(node_fqn(n), layer.fqn)
              and not _within(node_fqn(n), layer.fqn + ".base_layer")}
    for n in reversed(list(graph.nodes)):
        if n in branch and not n.users:
            graph.erase_node(n)
    return fx.GraphModule(gm, graph), vmap


def adapter_placements(layer: LoraLayer, base: Placement) -> tuple[Placement, Placement, str, str]:
    """(A's weight, B's weight, A's role, B's role) for a base weight placed ``base`` (module docstring's table)."""
    out_dim, in_dim = (0, 1) if layer.base.kind == "linear" else (1, 0)
    if isinstance(base, Shard) and base.dim == out_dim:
        return R, base.moved(0), "LoRA A, whole", "LoRA B, column-parallel"
    if isinstance(base, Shard) and base.dim == in_dim and base.blocks == 1 and not base.parts:
        return Shard(1), R, "LoRA A, row-parallel", "LoRA B, whole"
    if base == R:
        return R, R, "LoRA A, whole", "LoRA B, whole"
    raise PlanError(f"{layer.fqn}: LoRA on a base split as {base} has no split rule for its adapters; drop it from "
                    "--lora-targets, or give the base colwise(), rowwise() or replicate() in the plan")


def _refuse(layer: LoraLayer, why: str, tp: int) -> None:
    raise PlanError(f"{layer.fqn}: LoRA on this {layer.type_name} has no split rule at tp={tp} ({why}); drop it from "
                    "--lora-targets (or the peft config's target_modules), or train it at --tp 1")


def plan_lora(gm: fx.GraphModule, ops: list[WeightOp], layers: list[LoraLayer], params: set[fx.Node],
              user_inputs: set[fx.Node], plan_fn: Callable, placements_fn: Callable, tp: int):
    """Plan the bases as the model without adapters (``plan_fn(view, ops, params, user_inputs) -> ResolvedPlan``,
    ``placements_fn(ops, plan) -> (weights, forced, roles)``, on the planning view), then place each adapter by
    its base.  Returns the plan (the bases under their ``base_layer`` names, the adapters' entries from ``lora``),
    the weights' placements, the forced outputs and the modules' roles, all of ``gm``."""
    for layer in layers:
        if not layer.plain:
            why = ("its adapters are parameters read by an embedding lookup" if layer.base is not None
                   and layer.base.kind == "embedding" else "only vanilla LoRA with one adapter is split: a variant "
                   "(DoRA) or several adapters are not")
            _refuse(layer, why, tp)
    view, vmap = planning_view(gm, layers)
    back = {v: k for k, v in vmap.items()}
    wrapper = {layer.base.node: layer.fqn for layer in layers}
    adapters = {op.node for layer in layers for op in (layer.a, layer.b)}
    view_ops = [dataclasses.replace(op, node=vmap[op.node], weight=vmap[op.weight], fqn=wrapper.get(op.node, op.fqn),
                                    bias=vmap[op.bias] if op.bias is not None else None)
                for op in ops if op.node not in adapters]
    plan = plan_fn(view, view_ops, {vmap[p] for p in params}, {vmap[u] for u in user_inputs})
    weights, forced, roles = placements_fn(view_ops, plan)
    weights = {back[n]: p for n, p in weights.items()}
    forced = {back[n]: p for n, p in forced.items()}
    styles, sources = dict(plan.styles), dict(plan.sources)
    for layer in layers:
        if layer.base.node in forced:
            _refuse(layer, "its base is a head whose output is gathered", tp)
        a, b, role_a, role_b = adapter_placements(layer, weights.get(layer.base.weight, R))
        weights |= {layer.a.weight: a, layer.b.weight: b}
        if layer.fqn in styles:
            styles[layer.base.fqn] = styles.pop(layer.fqn)
            sources[layer.base.fqn] = sources.pop(layer.fqn)
        for op, p in ((layer.a, a), (layer.b, b)):
            styles[op.fqn], sources[op.fqn] = _style(p), LORA
        roles |= {layer.base.fqn: roles.get(layer.fqn, ""), layer.a.fqn: role_a, layer.b.fqn: role_b,
                  layer.fqn: "LoRA: base + scaling * B(A(x))"}
    used = plan.source.split("+") + ([LORA] if layers else [])
    return dataclasses.replace(plan, styles=styles, sources=sources, source="+".join(used)), weights, forced, roles


def _style(p: Placement) -> Style:
    """The style an adapter's placement reads as in the plan's table (Linear weights: ``[out, in]``)."""
    if isinstance(p, Shard):
        return colwise(packed=p.blocks) if p.dim == 0 else rowwise()
    return replicate()
