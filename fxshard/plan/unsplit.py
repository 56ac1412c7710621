"""What tensor parallelism left whole on every tp rank, and why (issue 31, section 3).

A layout that splits only the embedding and the head of a state-space model keeps about 90% of it on every rank;
the compile says so instead of leaving the user to find it in the table.  For each parameter no split reached
(``R`` on tp, or one part held whole by every rank), the reason is read off the plan and the graph:

* the plan replicates it;
* a size tp does not divide (a Linear's features, an Embedding's vocabulary, every dimension of a bare tensor);
* fewer heads or groups than tp (one part held whole by every rank, its gradients summed);
* no rule splits it: automatic pairing found no column/row pair within its module that splits without a
  gather inside it, a plan given by ``--plan`` or decorators (used as it is, without pairing) does not name it,
  or the ops that read it take it whole (norm weights, biases after a reduction).

Layers of a list are one line (``model.layers.*.norm.weight``)::

    report = unsplit_parameters(gm, ctx, ops)
    report.share            # 0.91: the part of the model every tp rank holds whole
    report.lines()          # ['backbone.layers.*.mixer: 81,920 parameters, no rule splits it ...', ...]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from fxshard.ir.context import CompileContext, spec
from fxshard.ir.placement import Replicate, Shard
from fxshard.plan.layers import WeightOp

WARN_SHARE = 0.10  # above this share of the parameters left whole over tp, the compile says which and why


@dataclass(frozen=True)
class UnsplitGroup:
    """Parameters of one kind of module left whole, with one reason (``modules``: a glob over the layers)."""

    modules: str
    params: int
    reason: str

    def to_json(self) -> dict:
        return {"modules": self.modules, "params": self.params, "reason": self.reason}


@dataclass(frozen=True)
class Unsplit:
    tp: int
    total: int  # the model's parameters (elements), unsharded, each tensor once
    whole: int  # of those, held whole by every tp rank
    groups: tuple[UnsplitGroup, ...]  # largest first

    @property
    def share(self) -> float:
        return self.whole / self.total if self.total else 0.0

    @property
    def warns(self) -> bool:
        return self.tp > 1 and self.share > WARN_SHARE

    def lines(self, most: int = 8) -> list[str]:
        out = [f"{g.modules}: {g.params:,} parameters, {g.reason}" for g in self.groups[:most]]
        rest = self.groups[most:]
        if rest:
            out.append(f"... and {len(rest)} more ({sum(g.params for g in rest):,} parameters)")
        return out

    def note(self) -> str:
        return (f"tp={self.tp} leaves {self.whole:,} of the model's {self.total:,} parameters "
                f"({100 * self.share:.0f}%) whole on every tp rank: " + "; ".join(self.lines()))

    def to_json(self) -> dict:
        return {"tp": self.tp, "total_params": self.total, "whole_params": self.whole,
                "whole_share": round(self.share, 4), "over_threshold": self.warns, "threshold": WARN_SHARE,
                "modules": [g.to_json() for g in self.groups]}


def unsplit_parameters(gm: fx.GraphModule, ctx: CompileContext, ops: list[WeightOp]) -> Unsplit:
    """The parameters the tensor-parallel pass left whole on every tp rank, grouped by module and reason."""
    tp = ctx.layout.tp
    names = ctx.program.state_by_name()
    by_weight = {}
    for op in ops:
        by_weight.setdefault(op.weight, op)
        if op.bias is not None:
            by_weight.setdefault(op.bias, op)
    total = whole = 0
    groups: dict[tuple[str, str], int] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node not in ctx.params:
            continue
        n = math.prod(node.meta["val"].shape)
        total += n
        p = spec(node).placement
        one_part = isinstance(p, Shard) and p.blocks == 1 and p.parts == (1,)
        if tp == 1 or not (p == Replicate() or one_part):
            continue
        whole += n
        fqn = names[node.name].fqn
        reason = _reason(node, fqn, by_weight.get(node), ctx, tp, one_part)
        module = fqn.rsplit(".", 1)[0] if "." in fqn else fqn
        key = (".".join("*" if part.isdigit() else part for part in module.split(".")), reason)
        groups[key] = groups.get(key, 0) + n
    ordered = sorted(groups.items(), key=lambda kv: (-kv[1], kv[0]))
    return Unsplit(tp, total, whole, tuple(UnsplitGroup(m, n, r) for (m, r), n in ordered))


def _no_style(source: str) -> str:
    """Why a weight no plan entry names stayed whole: pairing found nothing for it, or pairing did not run (a plan
    the user gave is used as it is; :mod:`fxshard.plan.auto`)."""
    given = [s for s in source.split("+") if s in ("user", "decorator")]
    if given:
        return (f"no rule: the {'+'.join(given)} plan does not name it (a plan given by --plan or decorators is used "
                "as it is, without automatic pairing; name the module in it)")
    shipped = "the model's own plan does not name it and " if "model" in source.split("+") else ""
    return (f"no rule: {shipped}automatic pairing found no column/row pair within its module that splits without a "
            "gather inside it")


def _reason(node: fx.Node, fqn: str, op: WeightOp | None, ctx: CompileContext, tp: int, one_part: bool) -> str:
    if one_part:
        return f"fewer heads or groups than tp={tp}: each rank holds the whole (gradients summed over tp)"
    shape = tuple(node.meta["val"].shape)
    style = ctx.plan.styles.get(op.fqn) if op is not None else None
    if style is not None and style.kind == "replicate":
        return "the plan replicates it"
    if op is not None and op.kind == "embedding" and shape[0] % tp:
        return f"a vocabulary of {shape[0]} that tp={tp} does not divide"
    if op is not None and op.kind != "embedding" and all(s % tp for s in shape):
        return f"a size ({' x '.join(map(str, shape))}) that tp={tp} does not divide"
    if op is not None and node is op.weight:
        return _no_style(ctx.plan.source) if style is None else "no rule: its plan style reached no split"
    if all(s % tp for s in shape):
        return f"a size ({' x '.join(map(str, shape))}) that tp={tp} does not divide"
    return "no rule splits it: the ops that read it take it whole (a norm over the whole width, a bias after a sum)"
