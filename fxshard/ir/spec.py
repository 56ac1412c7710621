"""Pass-to-pass facts about one node, under one key: ``node.meta["fxshard"]``, a frozen :class:`NodeSpec`; and the
arguments of inserted nodes that depend on the mesh (:class:`Group`, :class:`RankValue`)::

    update_spec(node, stage=1)
    spec(node).placement       # Shard(0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.fx as fx

from fxshard.ir.layout import Coords
from fxshard.ir.placement import Placement, Replicate


@dataclass(frozen=True)
class RankValue:
    """An argument whose value depends on the rank's coordinate on one mesh axis (e.g. a vocab offset)."""

    axis: str
    values: tuple

    def at(self, coords: Coords):
        return self.values[coords[self.axis]]


@dataclass(frozen=True)
class Group:
    """A process group argument of a collective: the mesh axis it communicates over."""

    axis: str

    def __str__(self) -> str:
        return self.axis


@dataclass(frozen=True)
class NodeSpec:
    """What the passes decided for one node: the one place a pass leaves a per-node fact for a later one.

    It lives in the graph with its node, so a pass that inserts or replaces nodes carries the facts along
    (or leaves the defaults, which say "not decided") instead of leaving a side table pointing at old nodes.
    """

    placement: Placement | tuple[Placement, ...] = Replicate()  # tensor_parallel: the output's placement on tp
    fqn: str = ""
    role: str = ""  # e.g. "column-parallel"; "" for ordinary compute
    collective: str = ""  # e.g. "all_reduce" for inserted communication
    # tensor_parallel -> collectives: the placement each tensor input (``tensor_args`` order) must have; the
    # collectives pass inserts a redistribution where an input has another.  None: the node takes its inputs
    # as they are (communication the collectives pass inserted)
    inputs: tuple[Placement, ...] | None = None
    # tensor_parallel -> collectives: a replicated node where split compute begins (an experts module's dispatch,
    # fxshard.ir.experts.dispatch_chain): its replicated inputs that need a gradient enter through copy_to (or
    # gather_to) here, as a split node's would, and its consumers read it without another
    enters: bool = False
    # capture (``label_markers``) -> pipeline: the number of fxshard.pipeline_split() markers before the node in
    # the forward.  None for nodes the passes inserted: they run with the next labelled node
    segment: int | None = None
    # pipeline: the stage computing the node (pp > 1).  None where no stage computes it: pp = 1, placeholders,
    # what only the model's other outputs need.  What crosses stages is derived from these (fxshard.ir.stages)
    stage: int | None = None
    # blocks: the repeated block (its FQN) whose generated submodule runs the node; "" for the nodes its class
    # runs itself.  What a block holds, reads and returns is derived from these (fxshard.ir.blocks)
    block: str = ""
    # context_parallel (--cp): the placement over cp, ``S(d)`` where the node holds this rank's tokens along d (in the
    # cp order), R where it holds every token; None without context parallelism
    seq: Placement | tuple[Placement, ...] | None = None


def spec(node: fx.Node) -> NodeSpec:
    return node.meta.get("fxshard", NodeSpec())


def update_spec(node: fx.Node, **changes) -> None:
    """Change some facts of ``node``'s (frozen) :class:`NodeSpec`, keeping the others::

        update_spec(node, stage=1)
    """
    node.meta["fxshard"] = dataclasses.replace(spec(node), **changes)
