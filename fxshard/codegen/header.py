"""The header of a rank file and its other prose: what the file runs, the collectives it issues and what each
does, the recompute and the pipeline it takes part in, and ``attach_data_parallel``'s docstring.

Everything here is read off the final graph and the layout; the body's lines are :mod:`fxshard.codegen.emit`'s::

    legend_lines(nodes)          # ['  rt.copy_to_linears  R: copy_to and the column-parallel linears ...', ...]
    collective_counts(entries)   # ('1 all_gather, 17 all_reduce', '17 all_reduce')
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard.codegen.lines import replica_elements, short_dtype
from fxshard.codegen.manifest import CollectiveEntry
from fxshard.ir.comm import KINDS, WIRE, amax_weights, buffer_is_input, op_group
from fxshard.ir.context import CompileContext, Group, spec
from fxshard.ir.cut import find_blocks, under
from fxshard.ir.layout import CP, CPTP, DP, EDP, EP, PP, TP, Coords, Layout
from fxshard.ir.placement import local_shape
from fxshard.units import human_bytes


def header_fields(ctx: CompileContext, coords: Coords, version: str, global_ranks: list[int], held: list[fx.Node],
                  skipped: set[fx.Node], collectives: Sequence[CollectiveEntry], blocks: list[str]) -> dict:
    """The header's variables of ``templates/rank.py.j2``: ``held``, the nodes the file runs (``skipped``: those
    training does not), ``collectives`` the file's (:mod:`fxshard.codegen.collective_list`), ``blocks`` the
    blocks it calls as submodules."""
    layout = ctx.layout
    unit, per_step = ("microbatch", ctx.microbatches) if ctx.pipeline is not None else ("step", 1)
    return {
        "version": version,
        "model_file": ctx.model_file_name,
        "digest": ctx.model_digest,
        "model_class": ctx.program.module_types[""],
        "layout": layout.describe(),
        "mesh": layout.mesh_shape,
        "mesh_axes": ", ".join(layout.mesh_axes),
        "coords_text": coords_text(coords, layout),
        "global_ranks": ", ".join(map(str, global_ranks)),
        "plan_source": ctx.plan.source,
        "plan_lines": ctx.plan_summary,
        "passes": ", ".join(ctx.passes_run + ["codegen"]),
        "collective_summary": summary(collectives),
        "collective_unit": unit,
        "collective_lines": collective_header(held, ctx, skipped, unit, per_step),
        "recompute_line": recompute_line(layout.recompute, blocks, f"{TP} and {EP}" if layout.ep > 1 else TP),
        "legend_lines": legend_lines(held),
        "pipeline_lines": pipeline_header(ctx, coords) if ctx.pipeline is not None else [],
    }


def recompute_line(mode: str, blocks: list[str], axes: str = TP) -> str:
    """What ``--recompute`` does in this file, for its header (``axes``: whose collectives run again)."""
    if mode == "none":
        return ""
    held = ", ".join(blocks) if len(blocks) <= 3 else f"{blocks[0]}, ..., {blocks[-1]} ({len(blocks)} blocks)"
    what = (f"keep only their inputs for backward; backward runs each one's forward again, its {axes} collectives "
            "included" if mode == "full" else
            "keep their matmul and fused-attention outputs for backward; backward recomputes the rest (norms, "
            f"activations, softmax, elementwise ops, {axes} collectives)")
    return f"recompute: {mode}: {held} {what}" if blocks else f"recompute: {mode}: no block of this rank to recompute"


_ZERO_TEXT = {
    0: ["gradients: DDP all-reduce (average) over dp in {mb} MB buckets, overlapping backward",
        "parameters and optimizer state: replicated on every dp rank"],
    1: ["fxshard's distributed optimizer (fxshard.runtime.distributed_optimizer, as Megatron-Core's; no DDP):",
        "the parameters are views of flat buckets (fxshard run --zero-bucket-mb, default {zmb:g} MB) and their",
        "gradients accumulate into flat gradient buckets; once per step, after the last backward, each bucket's",
        "gradients are reduce-scattered (average) over dp into this rank's 1/{dp} shard, AdamW steps that shard",
        "alone (its Adam state is the only copy), and the updated parameters are all-gathered, each bucket's",
        "gather waited for just before the next forward first uses it (fxshard run --no-overlap-param-gather:",
        "in the step): 2 collectives per bucket and step"],
    2: ["FSDP2 fully_shard on the dp mesh, reshard_after_forward=False: gradients reduce-scattered (average)",
        "as backward produces them; each dp rank keeps 1/{dp} of the gradients and optimizer state;",
        "parameters are all-gathered for forward and kept for backward"],
    3: ["FSDP2 fully_shard on the dp mesh, reshard_after_forward=True: each dp rank keeps 1/{dp} of the",
        "parameters, gradients and optimizer state; each repeated block (the module's BLOCKS) is a unit of",
        "its own: its parameters are all-gathered just before it runs, forward and again backward, and freed",
        "after it, the next block's gather issued while it computes; the rest of the module is one more",
        "unit; gradients are reduce-scattered (average) block by block as backward produces them"],
}


def _expert_attrs(ctx: CompileContext, attrs: dict[str, str]) -> list[str]:
    """Parameter names, as each module's ``named_parameters`` gives them (a stage's without its ``StageN.``
    prefix: ``attach_data_parallel`` gets one stage module at a time), of the experts passes/expert_parallel.py
    split."""
    state = ctx.program.state_by_name()
    return sorted({re.sub(r"^Stage\d+\.", "", k) for k, p in attrs.items() if state[p].fqn in ctx.expert_params})


def data_parallel_lines(ctx: CompileContext, global_ranks, attrs: dict[str, str]) -> tuple[list[str], list[str]]:
    """Docstring and body of the generated ``attach_data_parallel`` (only when dp > 1)."""
    from fxshard.defaults import ZERO_BUCKET_MB
    from fxshard.runtime.data_parallel import DDP_BUCKET_MB

    layout = ctx.layout
    if layout.replicas == 1:
        return [], []
    zero = layout.zero
    if layout.cp > 1:  # the cp ranks hold the same parameters too: gradients averaged over dp x cp (torchtitan's)
        doc = [f"Data parallelism over dp x cp = {layout.dp} x {layout.cp} (global ranks "
               f"{', '.join(map(str, global_ranks))} run this file, each dp rank on 1/{layout.dp} of the batch, each "
               f"cp rank on 1/{layout.cp} of its tokens; dp_mesh is the flattened dp_cp mesh), ZeRO stage {zero}:"]
    else:
        doc = [f"Data parallelism over dp = {layout.dp} (global ranks {', '.join(map(str, global_ranks))} run this "
               f"file, each on 1/{layout.dp} of the batch), ZeRO stage {zero}:"]
    zmb = ZERO_BUCKET_MB
    doc += ["    " + line.format(mb=DDP_BUCKET_MB, dp=layout.replicas, zmb=zmb) for line in _ZERO_TEXT[zero]]
    if zero == 1:
        if ctx.expert_params:
            doc.append(f"    expert parallelism ep = {layout.ep}: the experts (E/{layout.ep} per rank) have a "
                       f"distributed optimizer of their own over the {layout.size(EDP)} ranks holding the same experts "
                       f"(gradients summed over those and divided by {layout.replicas})")
        if layout.mixed:
            doc.append(f"    mixed precision: {layout.dtype} parameters, gradients and buckets; the optimizer keeps "
                       "fp32 master weights of its shard")
        body = ["return module  # the optimizer, built after this, takes the parameters into its buckets"]
    elif zero == 0 and ctx.expert_params:
        doc.append(f"    expert parallelism ep = {layout.ep}: the experts (E/{layout.ep} per rank) are not "
                   f"DDP's; their gradients are summed over the {layout.size(EDP)} ranks holding the same experts and "
                   f"divided by {layout.replicas} after backward (fxshard.runtime.experts.sync_expert_grads)")
        body = [f"return rt.ddp(module, dp_mesh, ignore={_expert_attrs(ctx, attrs)!r})"]
    elif zero == 0:
        body = ["return rt.ddp(module, dp_mesh)"]
        if layout.mixed:
            fp8 = " (the linears' products in float8)" if layout.fp8_recipe else ""
            low = "bf16" if layout.dtype == "fp8" else layout.dtype  # --dtype fp8: bf16 with float8 products
            doc.append(f"    mixed precision: {low} parameters and gradients{fp8}; the optimizer keeps fp32 master "
                       "weights")
    else:
        dtype = f", param_dtype=torch.{str(layout.compute_dtype).removeprefix('torch.')}" if layout.mixed else ""
        blocks = ", blocks=[getattr(module, b) for b in module.BLOCKS]" if zero == 3 else ""
        ignore = ""
        if ctx.expert_params:
            doc.append(f"    expert parallelism ep = {layout.ep}: the experts (E/{layout.ep} per rank) are "
                       f"not FSDP2's: held whole on the {layout.size(EDP)} ranks holding the same experts, their "
                       f"gradients summed over those and divided by {layout.replicas} after backward "
                       "(fxshard.runtime.experts.sync_expert_grads)")
            ignore = f", ignore={_expert_attrs(ctx, attrs)!r}"
        body = [f"return rt.fully_shard(module, dp_mesh, reshard_after_forward={zero == 3}{dtype}{blocks}{ignore})"]
        if layout.mixed:
            doc.append(f"    mixed precision: the fp32 shards are the master weights; gathered as {layout.dtype} "
                       "for compute, gradients reduce-scattered in fp32")
    return doc, body


def coords_text(coords: Coords, layout) -> str:
    text = f"tp rank {coords[TP]} of {layout.tp}"
    if layout.pp > 1:
        text = f"pp rank {coords[PP]} of {layout.pp}, " + text
    return text


def pipeline_header(ctx: CompileContext, coords) -> list[str]:
    layout = ctx.layout
    m = ctx.microbatches
    lines = [f"schedule {layout.schedule}, {layout.num_stages} stages ({layout.stages_per_rank} per pp rank), "
             f"{m} microbatches of {ctx.batch // layout.dp // m} per dp rank; cut: {ctx.pipeline.source}"]
    for row in ctx.pipeline.table:
        mine = "  <- this rank" if row["pp_rank"] == coords[PP] else ""
        lines.append(f"  stage {row['stage']} (pp rank {row['pp_rank']}): {row['holds']}{mine}")
    return lines


def collective_counts(collectives: Sequence[CollectiveEntry]) -> tuple[str, str]:
    """``("1 all_gather, 5 all_reduce", "5 all_reduce")``: one rank's collectives per step, forward and backward
    (without those only returning the model's other outputs needs, which training skips)."""
    return _counts([c for c in collectives if not c.outputs_only])


def _counts(collectives: Sequence[CollectiveEntry]) -> tuple[str, str]:
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    for c in collectives:
        for direction, counts in (("forward", fwd), ("backward", bwd)):
            for op, _ in KINDS[c.op].ops(direction):
                counts[op] = counts.get(op, 0) + 1
    return (", ".join(f"{n} {k}" for k, n in sorted(fwd.items())) or "none",
            ", ".join(f"{n} {k}" for k, n in sorted(bwd.items())) or "none")


def summary(collectives: Sequence[CollectiveEntry]) -> str:
    """The header's count of the collectives: ``forward 1 all_gather, 5 all_reduce; backward 5 all_reduce``."""
    f, b = collective_counts(collectives)
    text = f"forward {f}; backward {b}"
    extra = [c for c in collectives if c.outputs_only]
    if extra:
        more, _ = _counts(extra)
        text += f" (returning the model's other outputs adds {more})"
    return text


@dataclass(frozen=True)
class _Issue:
    """One backend operation a collective call issues: direction, operation, whole buffer (local) and dtype."""

    direction: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ranks: int = 0  # the size of its process group (0: tp's); the all-to-alls of --ep go over ep

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _issues(node: fx.Node, tp: int, ep: int = 1, dp: int = 1, cp: int = 1) -> list[_Issue]:
    kind = KINDS[node.target.__name__]
    out = []
    for direction in ("forward", "backward"):
        for op, amaxes in kind.ops(direction):
            group = op_group(node.args, node.kwargs, amaxes)
            axis = group.axis if isinstance(group, Group) else TP
            # rt.batch_mean goes over dp (passes/router_loss.py); fp8 amaxes under --cp over cp (x tp)
            ranks = {EP: ep, DP: dp, CP: cp, CPTP: cp * tp}.get(axis, 0)
            if amaxes:  # an fp8 call's amaxes, float32
                x = node.args[0]
                elements = kind.buffer(math.prod(local_shape(tuple(x.meta["val"].shape), spec(x).placement, tp)),
                                       [local_shape(tuple(w.meta["val"].shape), spec(w).placement, tp)
                                        for w in amax_weights(node.kwargs)], node.kwargs, direction)
                out.append(_Issue(direction, op, (int(elements),), torch.float32, ranks))
            elif kind.name == "sum_replicas":
                out.append(_Issue(direction, op, (replica_elements(node, tp),), node.args[0][0].meta["val"].dtype,
                                  ranks))
            else:
                whole = node.args[0] if buffer_is_input(kind, direction) else node
                val = whole.meta["val"]
                out.append(_Issue(direction, op, tuple(local_shape(tuple(val.shape), spec(whole).placement, tp)),
                                  val.dtype, ranks))
    return out


def _describe(issues: list[_Issue]) -> str:
    """``forward 2 all_reduce [2, 16, 64] f32; backward 2 all_reduce [2, 16, 64] f32``."""
    parts = []
    for direction in ("forward", "backward"):
        counts: dict[tuple, int] = {}
        for i in issues:
            if i.direction == direction:
                key = (i.op, i.shape, i.dtype)
                counts[key] = counts.get(key, 0) + 1
        if counts:
            parts.append(f"{direction} " + ", ".join(f"{n} {op} {list(shape)} {short_dtype(dt)}"
                                                     for (op, shape, dt), n in counts.items()))
    return "; ".join(parts)


def collective_header(nodes: list[fx.Node], ctx: CompileContext, skipped: set[fx.Node], unit: str,
                      per_step: int) -> list[str]:
    """The header lines on a rank's collectives: each repeated block's (runs of identical blocks said once),
    the rest's, and the bytes they move per ``unit`` and per step (``per_step`` units a step)."""
    tp = ctx.layout.tp
    blocks = find_blocks(ctx.program.module_types)
    runs: list[tuple[list[str], str]] = []  # (blocks, description), consecutive identical blocks merged
    per_block: dict[str, list[_Issue]] = {}
    rest: list[_Issue] = []
    for n in nodes:
        s = spec(n)
        if not s.collective or n in skipped or not KINDS[n.target.__name__].communicates:
            continue
        block = next((b for b in (blocks.names if blocks else []) if under(s.fqn, b)), None)
        (per_block.setdefault(block, []) if block else rest).extend(_issues(n, tp, ctx.layout.ep, ctx.layout.dp,
                                                                            ctx.layout.cp))
    for block, issues in per_block.items():
        text = _describe(issues)
        if runs and runs[-1][1] == text and _next_block(runs[-1][0][-1], block):
            runs[-1][0].append(block)
        else:
            runs.append(([block], text))
    if not runs and not rest:
        return []
    lines = []
    for held, text in runs:
        label = held[0] if len(held) == 1 else f"{held[0]}-{held[-1].rsplit('.', 1)[1]} (identical, each)"
        lines.append(f"  {label}: {text}")
    if rest:
        lines.append(f"  {'outside the blocks' if runs else 'all'}: {_describe(rest)}")
    everything = [i for issues in per_block.values() for i in issues] + rest
    moved = sum(i.bytes for i in everything)
    sent = sum(i.bytes * WIRE[i.op](i.ranks or tp) for i in everything)
    step = f", {_bytes_text(moved * per_step)} per step ({per_step} {unit}es)" if per_step > 1 else ""
    ep = f", ep={ctx.layout.ep}; all-to-all sizes as if routing were balanced" if ctx.layout.ep > 1 else ""
    lines.append(f"  buffers: {_bytes_text(moved)} per {unit}{step}; ring algorithms send about "
                 f"{_bytes_text(sent * per_step)} per step from each rank (tp={tp}{ep})")
    return lines


def _next_block(a: str, b: str) -> bool:
    return a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0] and int(b.rsplit(".", 1)[1]) == int(a.rsplit(".", 1)[1]) + 1


def _bytes_text(n: float) -> str:
    return human_bytes(n, digits=1)


def legend_lines(nodes: list[fx.Node]) -> list[str]:
    """What each collective the file's ``nodes`` call does, once (from :mod:`fxshard.ir.comm`), in the order of
    first use; ``copy_to_linears`` (the fused ``copy_to``, passes/overlap.py) and ``copy_to`` are said together
    where the first of them is used, the fused one first."""
    called = [n.target.__name__ for n in nodes if spec(n).collective]
    used = []
    for name in called:
        family = _COPY_TO if name in _COPY_TO else (name,)
        used += [w for w in family if w in called and w not in used]
    width = max((len(u) for u in used), default=0)
    return [f"  rt.{name:<{width}}  {KINDS[name].legend}" for name in used]


_COPY_TO = ("copy_to_linears", "copy_to")


def class_axes(gm: fx.GraphModule, layout: Layout) -> list[str]:
    """The process groups a generated class takes (without the pipeline's ``pp``): tp always, ep under expert
    parallelism, and every other axis a line of the graph names as ``self.<axis>``: a collective's (dp, for the
    whole-batch means of a load-balancing loss: passes/router_loss.py) or a local op's (``rt.own_rows``, which
    keeps this dp rank's rows of a whole-batch value without communicating)."""
    used = {a.axis for n in gm.graph.nodes for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
            if isinstance(a, Group)}
    return [axis for axis in (TP, EP, CP, CPTP, DP) if axis == TP or axis in used or (axis == EP and layout.ep > 1)]
