"""The weight-bearing ops a plan can split, and what each style means for their tensors.

A style is attached to a module FQN; in the captured graph that module is one or more ops whose
weight is a parameter placeholder:

=============  ===========================  ====================  =====================
op             module                       colwise               rowwise
=============  ===========================  ====================  =====================
aten.linear    nn.Linear (weight [out,in])  weight S(0), bias S(0) weight S(1), bias R
aten.addmm     GPT-2 Conv1D (weight [in,out]) weight S(1), bias S(0) weight S(0), bias R
aten.embedding nn.Embedding                 weight S(1)           weight S(0) (vocab)
=============  ===========================  ====================  =====================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.errors import PlanError
from fxshard.graph import node_fqn
from fxshard.ir.placement import Placement, Replicate, Shard
from fxshard.plan.packing import column_split
from fxshard.plan.styles import Style

aten = torch.ops.aten


@dataclass(frozen=True)
class WeightOp:
    node: fx.Node
    kind: str  # "linear" | "conv1d" | "embedding"
    fqn: str  # module FQN
    weight: fx.Node
    bias: fx.Node | None

    @property
    def type_name(self) -> str:
        return {"linear": "Linear", "conv1d": "Conv1D", "embedding": "Embedding"}[self.kind]


def weight_ops(gm: fx.GraphModule, params: set[fx.Node]) -> list[WeightOp]:
    ops = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.linear.default and n.args[1] in params:
            bias = n.args[2] if len(n.args) > 2 and n.args[2] in params else None
            ops.append(WeightOp(n, "linear", node_fqn(n), n.args[1], bias))
        elif n.target is aten.addmm.default and n.args[2] in params:
            ops.append(WeightOp(n, "conv1d", node_fqn(n), n.args[2], n.args[0] if n.args[0] in params else None))
        elif n.target is aten.embedding.default and n.args[0] in params:
            ops.append(WeightOp(n, "embedding", node_fqn(n), n.args[0], None))
    return ops


def infer_packing(op: WeightOp) -> int:
    """Number of equal parts the op's output is split into along its last dim (fused q/k/v: 3), else 1."""
    node = op.node
    seen = 0
    while seen < 4:
        users = list(node.users)
        if len(users) != 1:
            return 1
        (user,) = users
        packet = getattr(user.target, "overloadpacket", None)
        if packet in (aten.view, aten.reshape, aten._unsafe_view):
            node, seen = user, seen + 1
            continue
        if packet in (aten.split, aten.split_with_sizes, aten.chunk):
            ndim = len(node.meta["val"].shape)
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            parts = user.meta["val"]
            sizes = {p.shape[dim] for p in parts}
            if dim % ndim == ndim - 1 and len(sizes) == 1 and len(parts) > 1:
                return len(parts)
        return 1
    return 1


def style_placements(op: WeightOp, style: Style, tp: int) -> dict[fx.Node, Placement]:
    """Placements a style gives to an op's weight and bias at ``tp`` (a column split's blocks and parts:
    :func:`fxshard.plan.packing.column_split`)."""
    r = Replicate()
    if style.kind == "replicate":
        return {op.weight: r} | ({op.bias: r} if op.bias is not None else {})
    if op.kind == "embedding":
        if style.kind in ("vocab", "rowwise"):
            return {op.weight: Shard(0)}
        return {op.weight: Shard(1)}
    if style.kind == "vocab":
        raise PlanError(f"{op.fqn}: vocab_parallel() applies to an Embedding; this module is a {op.type_name}. "
                        "Use colwise() or rowwise() for linear layers.")
    out_dim, in_dim = (0, 1) if op.kind == "linear" else (1, 0)
    if style.kind == "colwise":
        w = column_split(op.node, out_dim, style.packed, tp)
        return {op.weight: w} | ({op.bias: w.moved(0)} if op.bias is not None else {})
    return {op.weight: Shard(in_dim)} | ({op.bias: r} if op.bias is not None else {})
