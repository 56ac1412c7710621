"""Pipeline parallelism at compile time: markers, repeated blocks, node costs, cuts, microbatches.

Where to cut, in order of precedence:

1. ``fxshard.pipeline_split()`` calls in the user's ``forward`` (export keeps them as marker ops);
2. ``split_before=["model.layers.8", ...]`` in the plan (``--split-before`` on the command line);
3. automatic: the model's repeated blocks (the outermost ``ModuleList`` with the most members, of one class
   or several, a member called several times a block per call: :func:`find_blocks`) are divided into
   contiguous groups, one per stage, minimizing the largest per-stage cost (FLOPs and parameter
   bytes, from the captured shapes); never inside a block.

The pass that cuts the graph (``passes/pipeline.py``) turns the cut positions into stages.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxshard.errors import LayoutError, PlanError
from fxshard.graph import module_call, node_fqn
from fxshard.ir.layout import Layout
from fxshard.ir.spec import update_spec

# ---------------------------------------------------------------- the marker

torch.library.define("fxshard::pipeline_split", "() -> ()")


@torch.library.impl("fxshard::pipeline_split", "CompositeExplicitAutograd")
def _pipeline_split_impl():
    return None


@torch.library.register_fake("fxshard::pipeline_split")
def _pipeline_split_fake():
    return None


PIPELINE_SPLIT = torch.ops.fxshard.pipeline_split.default
fx.node._side_effectful_functions.add(PIPELINE_SPLIT)  # export keeps the marker (as torch's pipe_split does)


def pipeline_split() -> None:
    """Mark a pipeline cut in a model's ``forward``: everything before runs in an earlier stage.

    Outside of ``fxshard compile`` it does nothing, so the model still runs as before::

        for i, layer in enumerate(self.layers):
            if i == 4:
                fxshard.pipeline_split()
            x = layer(x)
    """
    torch.ops.fxshard.pipeline_split()


def is_marker(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is PIPELINE_SPLIT:
        return True
    return str(node.target) == "pippy._pipe_split.default"  # torch.distributed.pipelining.pipe_split()


def label_markers(gm: fx.GraphModule) -> int:
    """Remove marker ops; label every node with the number of markers before it (``NodeSpec.segment``)."""
    segment, count = 0, 0
    for node in list(gm.graph.nodes):
        if is_marker(node):
            segment += 1
            count += 1
            gm.graph.erase_node(node)
            continue
        update_spec(node, segment=segment)
    if count:
        gm.recompile()
    return count


# ---------------------------------------------------------------- blocks and costs

_INDEXED = re.compile(r"^(.*)\.(\d+)$")


@dataclass
class Blocks:
    """The model's repeated blocks: ``prefix.0`` .. ``prefix.{n-1}``, the members of one ``ModuleList``, of one
    class or several (Jamba's Mamba and attention layers, Zamba2's Mamba and hybrid layers).

    ``names`` are the blocks in the order they run.  Found with the graph (:func:`find_blocks`'s ``gm``), a member
    the forward calls several times is a block per call, ``fqn@k`` (ALBERT's one layer, called N times): a
    pipeline cut may fall between its calls, and the stages holding them each hold its parameters."""

    prefix: str
    cls: str  # its class, or its classes joined by "/"
    names: list[str]

    def __len__(self) -> int:
        return len(self.names)

    def label_of(self, node: fx.Node) -> str | None:
        """The block (an entry of ``names``) that computes ``node``, or None outside the blocks."""
        fqn = node_fqn(node)
        if not under(fqn, self.prefix) or fqn == self.prefix:
            return None
        member = self.prefix + "." + fqn[len(self.prefix) + 1:].split(".", 1)[0]
        if member in self.names:
            return member
        call = module_call(node, member)
        label = f"{member}@{call}"
        return label if label in self.names else None


def find_blocks(module_types: dict[str, str], gm: fx.GraphModule | None = None) -> Blocks | None:
    """The model's repeated blocks: the ``ModuleList`` (members ``prefix.<i>``) with the most members, among those
    not inside another list's member (T5's ``block.0.layer`` of three sublayers is part of a block).  A list of
    one class wins a tie, and is preferred to a longer list of several classes only when that is inside it.
    With the graph ``gm``, members are counted by their calls, and a member called several times is a block per
    call (:class:`Blocks`)."""
    runs: dict[str, dict[int, str]] = {}
    for fqn, cls in module_types.items():
        m = _INDEXED.match(fqn)
        if m:
            runs.setdefault(m.group(1), {})[int(m.group(2))] = cls
    runs = {p: m for p, m in runs.items() if sorted(m) == list(range(len(m)))}
    calls = _calls(gm, runs) if gm is not None else {}
    best = None
    for prefix, members in runs.items():
        if any(_inside_member(prefix, other, runs[other]) for other in runs):
            continue
        names = [name for i in range(len(members)) for name in calls.get(f"{prefix}.{i}", [f"{prefix}.{i}"])]
        classes = sorted(set(members.values()))
        key = (len(names), len(classes) == 1, -prefix.count("."))
        if best is None or key > best[0]:
            best = (key, Blocks(prefix, "/".join(classes), names))
    if best is None:
        return None
    blocks = best[1]
    if gm is not None:  # in the order they run
        first = {}
        for node in gm.graph.nodes:
            label = blocks.label_of(node) if node.op == "call_function" else None
            if label is not None:
                first.setdefault(label, len(first))
        blocks.names.sort(key=lambda b: first.get(b, len(first)))
    return blocks


def _inside_member(prefix: str, other: str, members: dict[int, str]) -> bool:
    """Whether the list ``prefix`` lies inside a member ``other.<i>`` of the list ``other``."""
    if not prefix.startswith(other + "."):
        return False
    first = prefix[len(other) + 1:].split(".", 1)[0]
    return first.isdigit() and int(first) in members


def _calls(gm: fx.GraphModule, runs: dict[str, dict[int, str]]) -> dict[str, list[str]]:
    """Member FQN -> its blocks, for the members the forward calls more than once: ``fqn@0``, ``fqn@1``, ..."""
    members = {f"{p}.{i}" for p, m in runs.items() for i in m}
    seen: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            if value[0] in members:
                _, at, k = key.rpartition("@")
                seen.setdefault(value[0], set()).add(int(k) if at and k.isdigit() else 0)
    return {fqn: [f"{fqn}@{k}" for k in sorted(ks)] for fqn, ks in seen.items() if len(ks) > 1}


def under(fqn: str, prefix: str) -> bool:
    """Whether module ``fqn`` is ``prefix`` or inside it."""
    return fqn == prefix or fqn.startswith(prefix + ".")


def block_spans(compute: list[fx.Node], blocks: Blocks) -> tuple[dict[str, int], dict[str, int]]:
    """Index (in ``compute``) of each block's first and last node, for the blocks that compute anything."""
    starts: dict[str, int] = {}
    ends: dict[str, int] = {}
    for i, node in enumerate(compute):
        b = blocks.label_of(node)
        if b is not None:
            starts.setdefault(b, i)
            ends[b] = i
    return starts, ends


def _numel(shape) -> int:
    return math.prod(_size(s) for s in shape)


def _size(s) -> int:
    """A size for the cost of a cut; one that depends on the data (``logits[mask]``'s rows) at its upper bound."""
    if not isinstance(s, torch.SymInt):
        return int(s)
    node = s.node
    if node.hint is not None:
        return int(node.hint)
    upper = node.shape_env.bound_sympy(node.expr).upper
    return int(upper) if upper.is_finite else 1


def node_flops(node: fx.Node) -> int:
    """Forward FLOPs of one node from its captured (global) shapes; element count for other ops."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    name = getattr(node.target, "__name__", "")
    out = _numel(val.shape)

    def in_shape(i):
        a = node.args[i]
        v = a.meta.get("val") if isinstance(a, fx.Node) else None
        return tuple(v.shape) if isinstance(v, torch.Tensor) else ()

    if name.startswith(("linear", "mm", "bmm", "matmul")):
        k = in_shape(0)[-1] if in_shape(0) else 1
        return 2 * out * k
    if name.startswith("addmm"):
        k = in_shape(1)[-1] if in_shape(1) else 1
        return 2 * out * k
    if "scaled_dot_product" in name:
        q = in_shape(0)
        k = in_shape(1)
        if len(q) >= 2 and len(k) >= 2:
            return 4 * _numel(q[:-1]) * k[-2] * q[-1]
    return out


@dataclass
class Segment:
    """A piece of the program between possible cuts: the part before the blocks, a block, the part after."""

    name: str
    first: int  # index of its first compute node
    flops: int = 0
    param_bytes: int = 0
    cost: float = 0.0


def segments(compute: list[fx.Node], blocks: Blocks, param_uses: dict[fx.Node, list[int]],
             param_bytes: dict[fx.Node, int]) -> list[Segment]:
    """Split the compute nodes (graph order) into [before] + blocks + [after]; check the blocks are in order.
    A parameter counts in every segment that uses it: a stage holding a shared block's call holds its weights."""
    starts, ends = block_spans(compute, blocks)
    names = [b for b in blocks.names if b in starts]
    for a, b in zip(names, names[1:], strict=False):
        if starts[b] <= ends[a]:
            raise PlanError(
                f"{blocks.prefix}: blocks {a} and {b} run interleaved in the captured graph, so no cut "
                f"falls between them; mark the cuts with fxshard.pipeline_split() or use split_before"
            )
    segs = [Segment("(before blocks)", 0)] + [Segment(b, starts[b]) for b in names]
    last_end = ends[names[-1]] if names else -1
    segs.append(Segment("(after blocks)", last_end + 1))
    bounds = [s.first for s in segs] + [len(compute)]
    for j, seg in enumerate(segs):
        for node in compute[bounds[j]:bounds[j + 1]]:
            seg.flops += node_flops(node)
    for p, uses in param_uses.items():
        for j in {max(k for k in range(len(segs)) if segs[k].first <= i) for i in uses}:
            segs[j].param_bytes += param_bytes[p]
    total_f = sum(s.flops for s in segs) or 1
    total_b = sum(s.param_bytes for s in segs) or 1
    for s in segs:
        s.cost = s.flops / total_f + s.param_bytes / total_b
    return segs


def balance(costs: list[float], stages: int, before: float = 0.0, after: float = 0.0) -> list[int]:
    """Split ``costs`` (one per block) into ``stages`` contiguous non-empty groups; return group sizes.

    Minimizes the largest per-stage block cost; among the best, the largest stage cost counting the
    part before the blocks (first stage) and after them (last stage).  A uniform model whose block
    count the stages divide gets equal block counts.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    eps = 1e-12
    # best[k][i]: (max block cost, max total cost) splitting the first i blocks into k stages
    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                blk = prefix[i] - prefix[j]
                tot = blk + (before if k == 1 else 0.0) + (after if k == stages else 0.0)
                cand = (max(best[k - 1][j][0], blk), max(best[k - 1][j][1], tot))
                cur = best[k][i]
                if cand[0] < cur[0] - eps or (abs(cand[0] - cur[0]) <= eps and cand[1] < cur[1] - eps):
                    best[k][i], choice[k][i] = cand, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        j = choice[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


# ---------------------------------------------------------------- microbatches

def min_microbatches(layout: Layout) -> int:
    """Fewest microbatches the schedule runs with: GPipe any; 1F1B and the interleaved ones at least pp."""
    return 1 if layout.schedule == "gpipe" else layout.pp


def schedule_accepts(layout: Layout, m: int) -> bool:
    if m < min_microbatches(layout):
        return False
    if layout.schedule in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, m // layout.pp)
        return m % rounds == 0
    return True


def choose_microbatches(layout: Layout, batch: int, where: str) -> int:
    """``--microbatches`` checked against the batch and the schedule, or the default: the smallest count
    of at least pp (so every stage has work) that divides the batch and the schedule accepts."""
    m = layout.microbatches
    if m is not None:
        if batch % m:
            ok = [d for d in range(1, batch + 1) if batch % d == 0 and schedule_accepts(layout, d)]
            raise LayoutError(
                f"--microbatches {m}: the batch of {batch} ({where}) does not divide into {m} equal microbatches; "
                f"use --microbatches in {ok or '{}'} or change the batch size in make_inputs()"
            )
        if not schedule_accepts(layout, m):
            need = min_microbatches(layout)
            reason = (f"needs at least {need} microbatches (one per pp rank), else its warm-up never fills the "
                      "pipeline and torch's schedule stalls" if m < need else
                      f"needs the microbatch count to be a multiple of its rounds ({max(1, m // layout.pp)})")
            ok = [d for d in range(1, batch + 1) if batch % d == 0 and schedule_accepts(layout, d)]
            raise LayoutError(f"--microbatches {m}: schedule {layout.schedule} at pp={layout.pp} {reason}; "
                              f"use --microbatches in {ok or '{}'}")
        return m
    for d in range(max(layout.pp, 1), batch + 1):
        if batch % d == 0 and schedule_accepts(layout, d):
            return d
    ok = [d for d in range(1, batch + 1) if batch % d == 0 and schedule_accepts(layout, d)]
    if ok:
        return ok[0]
    raise LayoutError(
        f"the batch of {batch} ({where}) cannot be split into the {min_microbatches(layout)}+ microbatches "
        f"schedule {layout.schedule} needs at pp={layout.pp}; use a batch of at least {min_microbatches(layout)} "
        "(a multiple of it) in make_inputs(), or --schedule gpipe"
    )


# ---------------------------------------------------------------- the cut

@dataclass
class CutPlan:
    """Where the stages start: ``starts[s]`` = index (in compute-node order) of stage s's first node."""

    source: str  # "markers" | "split_before" | "auto"
    starts: list[int]
    labels: list[str]  # per stage: what it holds, e.g. "blocks.0-1 (+ before blocks)"
    table: list[dict] = field(default_factory=list)  # per stage: blocks, flops, param_bytes
