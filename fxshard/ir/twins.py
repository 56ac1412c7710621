"""The nodes of two captures of one program at different batch sizes, paired: what the batch-row analysis compares.

:mod:`fxshard.ir.rows` captures the model a second time at twice the rows and reads, node by node, how each value and
size changes.  The captures are one program but not always one graph: a capture leaves out an op that is a no-op at
its size (an ``expand`` to the shape a tensor already has at one row, a ``contiguous`` of a contiguous tensor).  This
pairs the ops that make tensors in order, skips such no-ops on either side, pairs each output of a tuple by its index,
and refuses what is another program (a branch on the batch size, pieces of a fixed size cut from the batch)::

    pairing = pair_nodes(program.gm, twice.gm, "model.py")
    pairing.twin[node]            # the node of the second capture computing the same value
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxshard.errors import LayoutError
from fxshard.graph import model_line, node_fqn

aten = torch.ops.aten


# ops a capture records only where they change the value (an ``expand`` to the shape a tensor has at one row, a
# ``contiguous`` of a tensor that already is): one capture may hold one the other does not
_NO_OPS = {aten.expand.default, aten.contiguous.default, aten.view.default, aten.reshape.default, aten.clone.default,
           aten.alias.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.slice.Tensor,
           aten.squeeze.dim, aten.squeeze.dims, aten.expand_as.default}


@dataclass
class Pairing:
    """The nodes of a program captured at the rows (``g1``) and at twice as many (``g2``): twins, and ops one capture
    holds as no-ops the other left out (valued as their input: ``same_as`` in ``g1``, ``extra`` in ``g2``)."""

    twin: dict[fx.Node, fx.Node] = field(default_factory=dict)
    same_as: dict[fx.Node, fx.Node] = field(default_factory=dict)
    extra: set[fx.Node] = field(default_factory=set)


def pair_nodes(g1: fx.GraphModule, g2: fx.GraphModule, where: str) -> Pairing:
    """Each node of ``g1`` with its twin in ``g2`` (the same program captured at other rows): placeholders by name,
    the ops that make tensors in order, each output of a tuple by its index; bookkeeping (sizes, runtime asserts) left
    out.  Refused where the programs differ."""
    def ops(g):
        return [n for n in g.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
                and _makes_tensors(n)]
    a, c = ops(g1), ops(g2)
    out = Pairing()
    second = {n.name: n for n in g2.graph.nodes if n.op == "placeholder"}
    out.twin.update((n, second[n.name]) for n in g1.graph.nodes if n.op == "placeholder" and n.name in second)
    i = j = 0
    while i < len(a):
        if j < len(c) and a[i].target == c[j].target and _returned_only(a[i]) and _more_values(a[i], c[j]):
            i, j = i + 1, j + 1  # values the model only returns, one per row: each part returns its own
        elif j < len(c) and a[i].target == c[j].target:
            _same_outputs(a[i], c[j], where)
            out.twin[a[i]] = c[j]
            i, j = i + 1, j + 1
        elif j < len(c) and c[j].target in _NO_OPS:
            out.extra.add(c[j])
            j += 1
        elif a[i].target in _NO_OPS and isinstance(a[i].args[0], fx.Node):
            out.same_as[a[i]] = a[i].args[0]
            i += 1
        else:
            raise LayoutError(
                f"{where}: the model's program at twice the rows differs from the one at the captured rows at "
                f"{a[i].name} ({a[i].target}); each data-parallel rank and pipeline microbatch runs the program on "
                "its rows, so it must be one program for every batch size (no branch on the batch size); train at "
                "--dp 1 without pipeline microbatches")
    for one in g1.graph.nodes:  # each output of a tuple by its index
        if one.op == "call_function" and one.target is operator.getitem and one.args[0] in out.twin:
            src = out.twin[one.args[0]]
            twin = next((u for u in src.users if u.target is operator.getitem and u.args[1] == one.args[1]), None)
            if twin is not None:
                out.twin[one] = twin
    return out


def _same_outputs(one: fx.Node, node: fx.Node, where: str) -> None:
    """Refuse an op that gives more values at more rows (pieces of a fixed size cut from the batch): the program's
    structure follows the batch, so no part of it runs as one device runs the whole."""
    many, few = node.meta.get("val"), one.meta.get("val")
    if isinstance(many, (tuple, list)) and isinstance(few, (tuple, list)) and len(many) != len(few):
        raise LayoutError(
            f"{where}: {node_fqn(one) or 'model'}: {op_name(one)} ({one.name}"
            + (f", {model_line(one)}" if model_line(one) else "") + f") gives {len(few)} values at the captured rows "
            f"and {len(many)} at twice as many (pieces of a fixed size cut from the batch): the program differs with "
            "the batch size, so a part of the batch cannot run it as one device runs the whole; cut pieces that "
            "follow the batch (a size from the tensor's shape), or train at --dp 1 without pipeline microbatches")


def _returned_only(node: fx.Node) -> bool:
    """A tuple of values the model only returns (the pieces of Llava's image features, one per image, which
    :mod:`fxshard.capture.rejoin` joined for the computation): each part returns its own, nothing computes with
    them, and there are as many as the part has rows."""
    return isinstance(node.meta.get("val"), (tuple, list)) and bool(node.users) and all(
        u.target is operator.getitem and u.users and all(w.op == "output" for w in u.users) for u in node.users)


def _more_values(one: fx.Node, node: fx.Node) -> bool:
    many, few = node.meta.get("val"), one.meta.get("val")
    return isinstance(many, (tuple, list)) and isinstance(few, (tuple, list)) and len(many) != len(few)


def _makes_tensors(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or isinstance(val, (tuple, list)) and any(
        isinstance(v, torch.Tensor) for v in val)


def op_name(node: fx.Node) -> str:
    """``aten.view.default``, or a function's name."""
    return str(node.target).replace("aten::", "aten.") if hasattr(node.target, "_schema") else getattr(
        node.target, "__name__", str(node.target))
