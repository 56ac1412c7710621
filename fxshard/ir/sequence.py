"""Which dimensions of each captured value follow the sequence length: what context parallelism splits and permutes.

Export bakes sizes into the graph, so the sequence dimension of a value (a mask's two, a rotary table's one, none of
a weight's) is found as ``fxshard plan`` finds its symbolic shapes: the model is captured a second time at another
sequence length, and a dimension whose size differs between the two captures follows the sequence.  The inputs'
sequence is dimension 1 of every tensor input of two or more dimensions whose size there is the example's length
(``input_ids``, ``attention_mask``, ``labels``, ``position_ids``), as ``fxshard plan`` reads it::

    seq = sequence_dims(mf, seed, inputs, program.gm)
    seq.length, seq.of(node)       # 64, (2, 3) for a [B, 1, S, S] mask
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxshard.errors import LayoutError


@dataclass(frozen=True)
class SequenceDims:
    """The captured sequence ``length`` and, per node name, the dimensions whose size follows it."""

    length: int
    dims: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def of(self, node: fx.Node) -> tuple[int, ...]:
        """``node``'s sequence dimensions (a node a pass inserted has none recorded)."""
        return self.dims.get(node.name, ())


def input_length(inputs) -> int | None:
    """The sequence length of a batch: dimension 1 of its first tensor of two or more dimensions."""
    return next((int(v.shape[1]) for v in pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor) and v.dim() >= 2),
                None)


def with_length(inputs, length: int, other: int):
    """``inputs`` cut to ``other`` tokens: dimension 1 of each tensor whose size there is ``length``."""
    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length:
            return v[:, :other].clone()
        return v
    return pytree.tree_map(cut, inputs)


def sequence_dims(capture, inputs, gm: fx.GraphModule, where: str) -> SequenceDims:
    """Compare ``gm`` (captured on ``inputs``) with ``capture(inputs at 3/4 of the length)``: each node's dimensions
    whose size differs.  ``where`` names the model file in errors.  The two graphs must be the same program: a model
    whose code takes other paths at another length cannot have its sequence split."""
    length = input_length(inputs)
    if length is None or length < 4:
        raise LayoutError(f"{where}: --cp splits the sequence (dimension 1 of the inputs), and make_inputs() gives "
                          f"{'no input with one' if length is None else f'{length} tokens'}; expected a batch of "
                          "[batch, sequence] tensors of at least 4 tokens")
    other = length - max(1, length // 4)
    second = capture(with_length(inputs, length, other))
    mine = [n for n in gm.graph.nodes]
    theirs = {n.name: n for n in second.graph.nodes}
    found: dict[str, tuple[int, ...]] = {}
    for node in mine:
        twin = theirs.get(node.name)
        if twin is None or twin.op != node.op or twin.target != node.target:
            raise LayoutError(
                f"{where}: the model's program at {other} tokens differs from the one at {length} at {node.name} "
                f"({node.target}); --cp needs one program for every sequence length (no branch on the length, no "
                "data-dependent shapes along it); drop --cp")
        found[node.name] = _differing(node.meta.get("val"), twin.meta.get("val"))
    return SequenceDims(length, found)


def _differing(a, b) -> tuple[int, ...]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim():
        return tuple(d for d in range(a.dim()) if a.shape[d] != b.shape[d])
    return ()
