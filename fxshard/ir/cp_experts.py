"""Context parallelism through a mixture-of-experts layer: its experts module as one token-local block.

Under ``--cp`` a rank holds its own tokens of every sequence.  The router computes each token on its own (a linear, a
softmax and a top-k over the experts: :mod:`fxshard.ir.cp_rules` keeps the split through them, as they run along
another dimension than the tokens).  The experts module (:mod:`fxshard.ir.experts`) then sorts the (token, choice)
pairs by expert, gathers their rows, runs two grouped matmuls with the counted rows per expert as offsets, weighs the
rows, puts them back in token order and sums each token's choices.  Op by op, the sort and the counts mix the tokens;
as a whole the module gives token t ``sum_j w[t, j] * expert_{e[t, j]}(x[t])``, its own rows alone, whatever other
tokens come with it (dropless: no capacity, no row dropped; the ops between the matmuls act on each row alone, as
expert parallelism also requires).  So a cp rank runs the module as written on its own tokens, and the sizes that
follow the sequence become this rank's (the pairs' ``arange``, the ``view`` to ``[T, k, H]``)::

    blocks = token_local_blocks(gm, fqn_of)         # one per experts module, its nodes in graph order
    why = block.not_token_local(sequence)           # None, or what breaks the pattern (the pass refuses, naming it)

What is not this pattern is decided op by op, where a sort along the tokens is refused with its module named.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.ir.experts import (
    _COMBINE_OPS,
    _DISPATCH_OPS,
    ROW_OPS,
    WEIGHT_OPS,
    grouped_mm_ops,
    grouped_mms,
    not_row_wise,
    offsets,
)

aten = torch.ops.aten
# besides the dispatch, the row-wise part and the combine: the pairs flattened and sorted by expert (the
# permutation), the token of each pair (``perm // k``), the rows counted per expert (``histc``, ``cumsum``: the
# offsets) and the inverse permutation (``empty_like(perm).index_put_([perm], arange(T * k))``)
_ORDER_OPS = {aten.sort.default, aten.sort.stable, aten.floor_divide.default, aten.histc.default, aten.cumsum.default,
              aten.empty_like.default, aten.arange.default, aten.index_put_.default, aten.index_put.default,
              aten.unsqueeze.default, operator.getitem}
BLOCK_OPS = _ORDER_OPS | _DISPATCH_OPS | _COMBINE_OPS | ROW_OPS | WEIGHT_OPS


@dataclass
class TokenBlock:
    """An experts module's nodes (``nodes``, graph order), its grouped matmuls, and the values it takes from
    outside (``inputs``) and gives outside (``outputs``)."""

    fqn: str
    nodes: list[fx.Node]
    mms: list[fx.Node]

    @property
    def inputs(self) -> list[fx.Node]:
        inside = set(self.nodes)
        return list(dict.fromkeys(a for n in self.nodes for a in n.all_input_nodes if a not in inside))

    @property
    def outputs(self) -> list[fx.Node]:
        inside = set(self.nodes)
        return [n for n in self.nodes if any(u not in inside for u in n.users)]

    def not_token_local(self, follows) -> str | None:
        """Why the module may compute other tokens than its own (None: each token's result is its own);
        ``follows(node)``: the dimensions of ``node`` that follow the sequence (:class:`SequenceDims.of`)."""
        if len(self.mms) != 2:
            return f"{len(self.mms)} grouped matmuls (expected two: gate/up, then down)"
        first, second = self.mms
        if offsets(first) is not offsets(second):
            return f"grouped matmuls {first.name} and {second.name} with different expert offsets"
        why = not_row_wise(first, second)
        if why is not None:
            return why
        mms = grouped_mm_ops()
        for n in self.nodes:
            if n.target not in BLOCK_OPS and n.target not in mms:
                return f"{n.name} ({n.target}), not an op of the experts' sort, dispatch, matmuls and combine"
            if n.target in (aten.arange.default,) and len(n.args) != 1:
                return f"{n.name} ({n.target}) with a start or step"
        for n in self.outputs:
            if 0 not in follows(n):
                return f"its output {n.name} has no token rows (dimension 0 does not follow the sequence)"
        return None


def token_local_blocks(gm: fx.GraphModule, fqn_of) -> list[TokenBlock]:
    """The experts modules of ``gm`` (found by their grouped matmuls), each with every node of its module and
    submodules (``fqn_of(node)``: the node's module FQN)."""
    blocks = []
    for fqn, mms in grouped_mms(gm, fqn_of).items():
        if not fqn:
            continue
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"
                 and (fqn_of(n) == fqn or (fqn_of(n) or "").startswith(fqn + "."))]
        blocks.append(TokenBlock(fqn, nodes, mms))
    return blocks
