"""``fxshard plan``: what a layout costs per rank, as sympy expressions in the batch ``B`` and sequence ``S``.

Nothing is written: the model is compiled in memory, and every tensor's shape is made symbolic by
capturing the model a second time at another size (twice the microbatch, 3/4 of the sequence) and
fitting each dimension to ``c * b**i * S**j`` (``b`` the microbatch rows, ``i`` in 0..1, ``j`` in 0..2).
A dimension that fits no such term (or several) stays a number.  ``b`` is then written in terms of
the global batch per step: ``b = B / (dp * microbatches)``.

Per pipeline rank (tp ranks hold equal shares) it reports bytes of parameters, gradients and
optimizer state (the ZeRO formulas of :mod:`fxshard.train.memory`), the bytes autograd saves for backward
per microbatch on each stage (:mod:`fxshard.cost.saved`), the microbatches the schedule keeps alive
(:mod:`fxshard.cost.alive`), the predicted peak (model state + saved x alive + a transient), and the
communication of one step on each mesh axis; and the schedule's bubble fraction::

    report = plan_costs("samples/gpt.py", Layout(tp=2, pp=2))
    report.ranks[0]["tp_allreduce"].expr        # 1088*B*S elements for samples/gpt.py
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxshard.capture.precision import capture_at
from fxshard.cost.alive import alive_counts
from fxshard.cost.saved import trace_saved
from fxshard.cost.zero_memory import formula, frozen_formula, peak_params
from fxshard.errors import LayoutError, NeedsRealWeights, OptionError
from fxshard.graph import largest_shape, loss_cone
from fxshard.ir.autograd import requires_grad
from fxshard.ir.blocks import block_units
from fxshard.ir.comm import KINDS, WIRE, amax_weights, buffer_is_input, op_group
from fxshard.ir.context import Group, spec
from fxshard.ir.cut import find_blocks, under
from fxshard.ir.layout import CP, CPTP, EDP, EP, TP, Coords, Layout
from fxshard.ir.placement import Shard, local_shape
from fxshard.ir.stages import pipeline_stages
from fxshard.units import human_bytes

B, S = sympy.symbols("B S", positive=True, integer=True)
_b = sympy.Symbol("b", positive=True, integer=True)  # microbatch rows, replaced by B / (dp * M)
_CAPTURE = object()  # _symbolic_shapes' default: capture the second size itself


@dataclass(frozen=True)
class Cost:
    expr: sympy.Expr
    at: dict  # {B: value, S: value}

    @property
    def value(self) -> float:
        return float(self.expr.subs(self.at))

    def to_json(self) -> dict:
        return {"expr": str(self.expr), "value": self.value}


@dataclass
class CostReport:
    layout: Layout
    at: dict
    ranks: list[dict] = field(default_factory=list)  # per pp rank: name -> Cost, plus "pp_rank", "global_ranks"
    recompute: str = "none"  # the mode the rows are for (auto: the one chosen)
    recompute_auto: bool = False  # chosen by --recompute auto
    bubble: Cost | None = None
    bubble_formula: str = ""
    notes: list[str] = field(default_factory=list)
    unsplit: dict | None = None  # what tp leaves whole on every rank, and why (fxshard.plan.unsplit)
    batch_per_dp: int | None = None  # the example batch of one dp rank, which the microbatches divide
    # the microbatch count chosen for --device-memory when --microbatches was not given (fxshard.cost.microbatches)
    microbatch_choice: dict | None = None

    @property
    def fits(self) -> bool:
        """Every rank's predicted peak fits ``--device-memory`` (True without it)."""
        return all(r.get("verdict", {}).get("fits", True) for r in self.ranks)

    def to_json(self) -> dict:
        def conv(v):
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            return v.to_json() if isinstance(v, Cost) else v

        return {"layout": self.layout.describe(), "symbols": {"B": "examples per step (all dp ranks)",
                                                               "S": "sequence length"},
                "at": {str(k): v for k, v in self.at.items()}, "recompute": self.recompute_summary(),
                "ranks": [{k: conv(v) for k, v in r.items()} for r in self.ranks],
                "bubble": conv(self.bubble) if self.bubble else None, "bubble_formula": self.bubble_formula,
                "notes": self.notes, "unsplit": self.unsplit, "microbatches": self.microbatch_choice}


    def recompute_summary(self) -> dict:
        """The mode, whether ``auto`` chose it, and per mode the worst rank's predicted peak (bytes) and the
        FLOPs it adds (share of a step, the rank that adds most)."""
        modes = [m for m in RECOMPUTE_ORDER if all(m in r["recompute_peaks"] for r in self.ranks)]
        return {"mode": self.recompute, "auto": self.recompute_auto,
                "peaks": {m: max(r["recompute_peaks"][m].value for r in self.ranks) for m in modes},
                "worst_rank": {m: max(self.ranks, key=lambda r: r["recompute_peaks"][m].value)["pp_rank"]
                               for m in modes},
                "flops": {m: max(r["recompute_flops"][m] for r in self.ranks) for m in modes}}


EP_NOTE = ("ep all-to-all: the balanced (expected) volume, under uniform routing: each rank keeps the rows routed "
           "to its own experts (1/{n}) and sends the other (N-1)/N of its tokens x top-k rows, out and back, forward "
           "and backward; the real volume depends on the routing, step by step (what leaves a rank for another "
           "counts; rows routed to the same rank do not cross the network)")
RECOMPUTE_ORDER = ("none", "selective", "full")  # least recompute first: what --recompute auto tries in turn

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size as people write it: ``80GiB`` (2**30), ``80GB`` (10**9), ``512 MiB``, ``1.5TiB``, ``1000``."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise OptionError(f"--device-memory {text!r}: expected a positive size with a unit, e.g. 80GiB, 80GB, "
                          "16GiB, 512MiB (KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB of 1000)")
    return int(float(m.group(1)) * _UNITS[unit])


def verdict(peak: float, device_memory: int) -> dict:
    """Whether a rank's predicted peak fits a device of ``device_memory`` bytes, and by how much."""
    return {"device_memory": device_memory, "fits": peak <= device_memory, "headroom": device_memory - peak}


def bubble_fraction(layout: Layout) -> tuple[sympy.Expr, str]:
    """Idle fraction of a pp rank: (p-1)/(m+p-1); interleaving divides the warm-up by the stages per rank."""
    p, m, v = layout.pp, layout.microbatches or 1, layout.stages_per_rank
    if p == 1:
        return sympy.Integer(0), "0 (no pipeline)"
    if v == 1:
        return sympy.Rational(p - 1, m + p - 1), "(p-1)/(m+p-1)"
    return sympy.Rational(p - 1, v * m + p - 1), "(p-1)/(v*m+p-1)"


def plan_costs(model_file: str | Path, layout: Layout, plan: dict | None = None, seed: int = 0,
               batch: int | None = None, seq: int | None = None, device_memory: int | None = None) -> CostReport:
    """Compile in memory and cost the layout; evaluate at ``batch``/``seq`` (default: the example's); with
    ``device_memory`` (bytes), each rank gets a ``verdict``: whether its predicted peak fits.

    With ``device_memory``, a pipeline whose ``--microbatches`` was not given gets the fewest microbatches that fit
    (:func:`fxshard.cost.microbatches.fit_microbatches`): the default count when it fits, else the fewest larger
    count that divides the batch and under which every rank fits (with ``--recompute auto``: under the least
    recompute that fits at that count); ``report.microbatch_choice`` says what was tried."""
    from fxshard.capture.modelfile import load_model_file
    from fxshard.cost.microbatches import fit_microbatches

    if layout.recompute == "auto" and device_memory is None:
        raise OptionError("--recompute auto: expected --device-memory SIZE (e.g. 80GiB) to choose the least "
                          "recompute that fits; found none; add --device-memory, or name a mode: "
                          "--recompute none|selective|full")
    mf = load_model_file(model_file).for_layout(layout)

    def at_microbatches(m: int | None) -> CostReport:
        return _plan_at(mf, dataclasses.replace(layout, microbatches=m), plan, seed, batch, seq, device_memory)

    report = at_microbatches(layout.microbatches)
    if device_memory is not None and layout.pp > 1 and layout.microbatches is None:
        report = fit_microbatches(report, at_microbatches, device_memory)
    if report.recompute_auto and not report.fits:
        choose_recompute([{m: r | {"peak": c} for m, c in r["recompute_peaks"].items()} for r in report.ranks],
                         device_memory, report.microbatch_choice)  # raises: no mode fits
    return report


def _plan_at(mf, layout: Layout, plan, seed, batch, seq, device_memory) -> CostReport:
    """The plan of ``layout`` as given (its microbatches: the default count when None); under ``--recompute auto``
    the least mode that fits, or ``full`` with ``report.fits`` False when none does (the caller refuses it)."""
    from fxshard.compiler import compile_program

    asked = layout.recompute
    # recompute changes how the generated code calls the blocks, not the graph: compile once, trace each mode
    try:  # shapes only, on meta tensors: a 70B shape costs in seconds
        result = compile_program(mf, dataclasses.replace(layout, recompute="none"), plan, seed, meta=True)
    except NeedsRealWeights:  # data-dependent code, specialized from a run of the model on the example batch
        result = compile_program(mf, dataclasses.replace(layout, recompute="none"), plan, seed)
    ctx, gm = result.ctx, result.gm
    layout = ctx.layout
    micro = [i for i in ctx.program.inputs if i.is_tensor]
    b = micro[0].shape[0] if micro else 1
    s = next((i.shape[1] for i in micro if len(i.shape) >= 2), None)
    state = {n for n in gm.graph.nodes if n.op == "placeholder" and n not in ctx.user_inputs}
    sym, notes = _symbolic_shapes(mf, layout, seed, gm, b, s, state)
    per_step_b = layout.dp * ctx.microbatches
    at = {B: batch if batch is not None else b * per_step_b, S: seq if seq is not None else (s or 1)}
    modes = [_rank_costs(gm, ctx, pp_rank, sym, at, per_step_b) for pp_rank in range(layout.pp)]
    chosen = (fitting_recompute(modes, device_memory) or RECOMPUTE_ORDER[-1]) if asked == "auto" else asked
    if chosen not in modes[0]:
        chosen = "none"  # a model without repeated blocks: the compiler refuses recompute for it
    layout = dataclasses.replace(layout, recompute=chosen)
    if layout.ep > 1:
        notes.append(EP_NOTE.format(n=layout.ep))
    if ctx.unsplit is not None and ctx.unsplit.warns:
        notes.append(ctx.unsplit.note())
    report = CostReport(layout, at, notes=notes, recompute=chosen, recompute_auto=asked == "auto",
                        unsplit=ctx.unsplit.to_json() if ctx.unsplit is not None else None,
                        batch_per_dp=ctx.batch // layout.dp if ctx.batch else None)
    for by_mode in modes:
        report.ranks.append(by_mode[chosen])
        if device_memory is not None:
            report.ranks[-1]["verdict"] = verdict(report.ranks[-1]["peak"].value, device_memory)
    expr, text = bubble_fraction(layout)
    report.bubble, report.bubble_formula = Cost(expr, at), text
    return report


def fitting_recompute(ranks: list[dict[str, dict]], device_memory: int | None) -> str | None:
    """The least recompute (none < selective < full) under which every rank's predicted peak fits
    ``device_memory`` bytes, or None; ``ranks``: per pp rank, mode -> that rank's costs under the mode."""
    modes = [m for m in RECOMPUTE_ORDER if all(m in r for r in ranks)]
    for mode in modes:
        if device_memory is not None and all(r[mode]["peak"].value <= device_memory for r in ranks):
            return mode
    return None


def choose_recompute(ranks: list[dict[str, dict]], device_memory: int, microbatches: dict | None = None) -> str:
    """:func:`fitting_recompute`, refused when no mode fits (``microbatches``: the counts tried, for the message)."""
    mode = fitting_recompute(ranks, device_memory)
    if mode is not None:
        return mode
    last = [m for m in RECOMPUTE_ORDER if all(m in r for r in ranks)][-1]
    worst = max(ranks, key=lambda r: r[last]["peak"].value)[last]
    tried = ""
    if microbatches:  # the default count did not fit, nor any other that divides the batch
        tried = (f" at the default {microbatches['chosen']} microbatches, and no other count that divides the batch "
                 f"of {microbatches['batch_per_dp']} per dp rank fits (worst rank's peak by count: "
                 f"{_tried(microbatches)})")
    raise LayoutError(
        f"--recompute auto: expected a recompute mode under which every rank fits --device-memory "
        f"{_gib(device_memory)}; found none: pp rank {worst['pp_rank']} (global ranks "
        f"{', '.join(map(str, worst['global_ranks']))}) is predicted to peak at {_gib(worst['peak'].value)} even "
        f"under --recompute {last}{tried}; use more --pp or --tp, more microbatches (a smaller --batch per step), "
        "ZeRO stage 1-3 with --dp, or a larger device")


def _tried(choice: dict) -> str:
    return ", ".join(f"{m}: {human_bytes(p)}" for m, p in sorted(choice["tried"].items()))


def _gib(n: float) -> str:
    return f"{human_bytes(n)} ({n:.0f} bytes)"


def planned_memory(out: str | Path) -> dict[int, dict] | str:
    """What ``fxshard plan`` predicts for a compiled folder, per pp rank (``saved``, ``peak``, ``alive`` at the
    compiled sizes), for ``fxshard run --memory-report``; or why it cannot (a plan file or ``--split-before``
    is not recorded in the folder in a form the plan can be recomputed from)."""
    from fxshard.codegen.manifest import read_manifest

    manifest = read_manifest(out)
    if "user" in manifest.plan_source.split("+") or (manifest.pipeline and manifest.pipeline.cut == "split_before"):
        return "no plan figures: compiled with a plan file or --split-before, which the folder does not record"
    report = plan_costs(Path(out) / manifest.model_file, manifest.layout, seed=manifest.seed)
    return {r["pp_rank"]: {"saved": r["saved"].value, "peak": r["peak"].value, "alive": int(r["alive"].value)}
            for r in report.ranks}


def _symbolic_shapes(mf, layout, seed, gm, b: int, s: int | None, state: set[fx.Node], second=_CAPTURE):
    """Node name -> global shape as expressions in ``_b`` and ``S``, fitted from a second capture (``state``: the
    parameter and buffer placeholders, whose sizes stay numbers); ``second``: that capture's graph when the caller
    made it (:mod:`fxshard.cost.profile` fits three compiles to one), None when the model captures at one size."""
    s2 = (s * 3 // 4 if s % 4 == 0 else s - 1) if s and s > 2 else s
    notes = []
    if second is _CAPTURE:
        second = _capture_second(mf, layout, seed, b, s, s2, notes)
    elif second is None:
        notes.append("shapes stay numeric: the model does not capture at another size")
    other = {n.name: n.meta.get("val") for n in second.graph.nodes} if second is not None else {}

    out, unfitted = {}, 0
    fixed = _state_only(gm, state)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if node in fixed:
            out[node.name] = tuple(sympy.Integer(d) for d in val.shape)
            continue
        val2 = other.get(node.name)
        if not isinstance(val2, torch.Tensor) or val2.dim() != val.dim():
            val2 = _source_val(node, other)
        if val2 is None:  # inserted by a pass (a bias add after an all-reduce): its inputs' fitted sizes
            dims = _collective_dims(node, out) or _dims_from_inputs(node, out)
            out[node.name] = dims
            unfitted += all(isinstance(d, sympy.Integer) for d in dims)
            continue
        split = _cp_split(node, layout.cp)  # under --cp: the dimension holding this rank's 1/cp of the tokens
        out[node.name] = tuple(_fit(d1 * layout.cp, d2, b, s or 1, 2 * b, s2 or 1) / layout.cp if d == split else
                               _fit(d1, d2, b, s or 1, 2 * b, s2 or 1)
                               for d, (d1, d2) in enumerate(zip(largest_shape(val), largest_shape(val2), strict=True)))
    if unfitted and second is not None:
        notes.append(f"{unfitted} values kept numeric shapes (no counterpart at the second size)")
    return out, notes


def _capture_second(mf, layout, seed, b: int, s: int | None, s2: int | None, notes: list[str]):
    """The model captured at twice the microbatch ``b`` and ``s2`` instead of ``s``: its graph, or None."""
    inputs = mf.build_inputs(seed)

    def resize(v):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v
        v = v[:b]
        if s2 is not None and v.dim() >= 2 and v.shape[1] == s:
            v = v[:, :s2]
        return torch.cat([v, v])

    dtype = layout.compute_dtype if layout.mixed else None
    try:
        try:
            return capture_at(mf, seed, pytree.tree_map(resize, inputs), dtype, meta=True).gm
        except NeedsRealWeights:
            return capture_at(mf, seed, pytree.tree_map(resize, inputs), dtype).gm
    except Exception as e:  # a model that only runs at its example size: costs stay numbers
        notes.append(f"shapes stay numeric: the model does not capture at another size ({type(e).__name__})")
        return None


def _cp_split(node: fx.Node, cp: int) -> int | None:
    """The dimension along which ``node`` holds 1/cp of the sequence (passes/context_parallel.py), or None: its own
    placement over cp, or for a node a later pass inserted (a tp collective) that of its input of as many
    dimensions."""
    if cp == 1:
        return None
    for n in (node, *node.all_input_nodes):
        p = spec(n).seq
        if p is not None:
            if n is not node and getattr(n.meta.get("val"), "dim", lambda: -1)() != node.meta["val"].dim():
                continue
            return p.dim if isinstance(p, Shard) else None
    return None


def _state_only(gm: fx.GraphModule, state: set[fx.Node]) -> set[fx.Node]:
    """The parameters and buffers (``state``) and the nodes made from them alone: their sizes do not follow
    the batch.  Under ``--ep`` a rank's stacked experts ``[E/ep, ...]`` would otherwise fit the microbatch
    when E/ep happens to equal it, as the second capture's E does twice the microbatch."""
    fixed: set[fx.Node] = set()
    for node in gm.graph.nodes:
        ins = node.all_input_nodes
        if node in state or (node.op == "call_function" and ins and all(a in fixed for a in ins)):
            fixed.add(node)
    return fixed


def _collective_dims(node: fx.Node, fitted: dict) -> tuple | None:
    """An inserted collective's dimensions from its input's (a gather over cp after a tp gather, both inserted): a
    dimension it gathers or splits scales its input's expression by the ratio of their sizes (``S/4`` gathered over
    cp=4 is ``S``), which matching sizes would take for another dimension of the same size (the microbatch)."""
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if not spec(node).collective or src is None or src.name not in fitted:
        return None
    mine, theirs = node.meta.get("val"), src.meta.get("val")
    if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor) or mine.dim() != theirs.dim():
        return None
    return tuple(e if a == d else e * sympy.Rational(a, d) for a, d, e in zip(mine.shape, theirs.shape,
                                                                           fitted[src.name], strict=True))


def _dims_from_inputs(node: fx.Node, fitted: dict) -> tuple:
    """Each dimension of ``node`` as the fitted expression of an input dimension of the same size: the one
    at the same position if there is one, else the first; a size no input has stays a number (e.g. the
    vocab-parallel cross entropy's ``[tokens, tp, 2]`` from logits ``[tokens, vocab]``).  From elsewhere, never a 1
    nor an expression an earlier dimension took (:func:`fxshard.cost.saved._matched` says why)."""
    inputs = [(a.meta["val"].shape, fitted[a.name]) for a in node.all_input_nodes
              if a.name in fitted and isinstance(a.meta.get("val"), torch.Tensor)]
    dims = []
    for i, size in enumerate(node.meta["val"].shape):
        same_place = [e[i] for shp, e in inputs if i < len(shp) and shp[i] == size]
        anywhere = [e[j] for shp, e in inputs for j, d in enumerate(shp)
                    if d == size and size != 1 and e[j] not in dims]
        dims.append((same_place or anywhere or [sympy.Integer(size)])[0])
    return tuple(dims)


def _source_val(node: fx.Node, other: dict):
    """An inserted node (collective) has its source value's shape."""
    for a in node.all_input_nodes:
        v = other.get(a.name)
        if isinstance(v, torch.Tensor) and isinstance(node.meta.get("val"), torch.Tensor) and \
                v.dim() == node.meta["val"].dim():
            return v
    return None


def _fit(d1: int, d2: int, b: int, s: int, b2: int, s2: int) -> sympy.Expr:
    fits = []
    for i in (0, 1):
        for j in (0, 1, 2):
            den = b**i * s**j
            if d1 % den == 0 and (d1 // den) * b2**i * s2**j == d2:
                fits.append(sympy.Integer(d1 // den) * _b**i * S**j)
    return fits[0] if len(fits) == 1 else sympy.Integer(d1)


def _rank_costs(gm, ctx, pp_rank: int, sym: dict, at: dict, per_step_b: int) -> dict[str, dict]:
    """One pp rank's costs, per recompute mode (only ``none`` for a model without repeated blocks)."""
    from fxshard.ir.fake import local_value_shapes

    layout = ctx.layout
    coords = Coords(pp=pp_rank)
    local = local_value_shapes(gm, ctx, coords)
    if ctx.pipeline is not None:
        all_stages = pipeline_stages(gm, ctx)
        stages = [all_stages[i] for i in layout.stages_of(pp_rank)]
        nodes = [n for st in stages for n in st.nodes]
        state = [n for st in stages for n in st.state]
    else:
        stages = []
        cone = loss_cone(gm)  # training skips what only the model's other outputs need
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n in cone]
        state = [n for n in gm.graph.nodes if n.op == "placeholder" and n in ctx.params]
    micro = sympy.Rational(1, 1) * B / per_step_b

    def dims(node) -> tuple:  # local dimensions of one microbatch
        g = largest_shape(node.meta["val"])
        mine = largest_shape(local[node]) if node in local else local_shape(g, spec(node).placement, layout.tp)
        return tuple((expr * sympy.Rational(n, d) if d else expr).subs(_b, micro)
                     for expr, n, d in zip(sym[node.name], mine, g, strict=True))

    def numel(node) -> sympy.Expr:  # local elements of one microbatch
        return sympy.expand(math.prod(dims(node), start=sympy.Integer(1)))

    def nbytes(node) -> sympy.Expr:
        return numel(node) * node.meta["val"].element_size()

    tensors = [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor) and n in local]
    psi = sum(math.prod(local_shape(tuple(n.meta["val"].shape), spec(n).placement, layout.tp))
              for n in state if n in ctx.params)
    m = ctx.microbatches
    moved = _tp_elements([n for n in nodes if spec(n).collective], numel, layout.tp)  # rt.copy_to_linears: a tuple
    row = {"pp_rank": pp_rank,
           "global_ranks": [r for r in range(layout.world_size) if layout.coords(r).pp == pp_rank],
           "psi": Cost(sympy.Integer(psi), at)}
    experts = _expert_psi(state, ctx, layout)  # this rank's E/ep experts: state of their own (none without --ep)
    frozen = _frozen_psi(state, ctx, layout)  # requires_grad=False: the parameter alone, no gradient or Adam state
    mem = formula(layout.zero, layout.replicas, layout.mixed, psi - experts - frozen)  # ZeRO shards over dp x cp
    still = frozen_formula(layout.zero, layout.replicas, layout.mixed, frozen)
    for key in ("params", "grads", "optimizer"):
        row[key] = Cost(sympy.nsimplify(mem[key] + still[key] + expert_state(layout, experts)[key]), at)
    if frozen:
        row["frozen_psi"] = Cost(sympy.Integer(frozen), at)
    row["params_peak"] = Cost(sympy.nsimplify(peak_params(layout.zero, layout.replicas, layout.mixed, psi - experts,
                                                          _block_params(state, ctx, layout))
                                              + expert_state(layout, experts)["params"]), at)
    row["forward_values"] = Cost(sum((nbytes(n) for n in tensors), sympy.Integer(0)), at)
    traces = _traces(gm, ctx, stages, nodes, state, coords, local, dims, at)
    by_mode = {mode: _peak(row, mem, layout, pp_rank, m, at, _recompute_extra(traces["none"], mem, at))
               for mode, mem in traces.items()}
    row["recompute_peaks"] = {mode: r["peak"] for mode, r in by_mode.items()}
    row["recompute_flops"] = _flop_overhead(traces["none"])
    # tensor parallel, elements per step: all-reduces in forward (row-parallel outputs) and backward
    # (inputs of column-parallel layers), all-gathers (gathered outputs, scattered inputs' gradients)
    # (sequence parallelism: reduce-scatters; a ring all-reduce sends twice what a gather or a reduce-scatter of
    # the same buffer does, so tp_sent shows --sp moving what the all-reduces it replaces moved)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        row[f"tp_{op.replace('_', '')}"] = Cost(sympy.expand(moved.get(op, 0) * m) if layout.tp > 1
                                                else sympy.Integer(0), at)
    row["tp_sent"] = Cost(sympy.nsimplify(sum((sympy.nsimplify(WIRE[op](layout.tp)) * moved[op] * m for op in moved),
                                              sympy.Integer(0))) if layout.tp > 1 else sympy.Integer(0), at)
    row["pp_send"] = Cost(_pipeline_elements(gm, stages, numel, ctx, m, layout), at)
    row["dp_bytes"] = Cost(sympy.nsimplify(_dp_bytes(layout, psi - experts - frozen, m if ctx.pipeline is not None
                                                     else 1, frozen=frozen)
                                           + _expert_dp_bytes(layout, experts)), at)
    if layout.cp > 1:
        row["cp_sent"] = Cost(sympy.expand(_cp_bytes(nodes, numel, layout) * m), at)
    if layout.ep > 1:
        row["ep_psi"] = Cost(sympy.Integer(experts), at)
        row["ep_state"] = Cost(sympy.nsimplify(expert_state(layout, experts)["total"]), at)
        row["ep_alltoall"] = Cost(sympy.expand(_all_to_all_bytes(tensors, numel, layout) * m), at)
    return {mode: row | peak for mode, peak in by_mode.items()}


def _traces(gm, ctx, stages, nodes, state, coords, local, dims, at) -> dict[str, dict]:
    """Recompute mode -> {stage index: StageMemory}: each stage traced as the generated code runs it under that
    mode (its repeated blocks as passes/blocks.py recorded them); only ``none`` for a model without blocks."""
    if stages:
        spans = [(st.index, st.nodes, st.state, [*st.inputs, *st.batch, *st.outputs], set(st.outputs),
                  set(st.recomputed))
                 for st in stages]
    else:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        spans = [(0, nodes, state, [], set(out.all_input_nodes), set())]
    units = {i: block_units(ns, sn, keep, exclude) for i, ns, sn, _, keep, exclude in spans}
    modes = RECOMPUTE_ORDER if any(units.values()) else ("none",)
    return {mode: {i: trace_saved(ns, ctx, coords, local, dims, at, held=held, recompute_mode=mode, units=units[i])
                   for i, ns, _, held, _, _ in spans} for mode in modes}


def _recompute_extra(none: dict, mem: dict, at: dict) -> sympy.Expr:
    """What backward holds again while it recomputes one block: the block's forward as kept without recompute,
    less what the mode kept of it anyway; the largest block of the rank (one block recomputes at a time)."""
    extra = [none[i].blocks[b] - mem[i].blocks[b] for i in mem for b in mem[i].blocks]
    return max(extra, key=lambda e: float(e.subs(at)), default=sympy.Integer(0))


def _flop_overhead(none: dict) -> dict[str, float]:
    """FLOPs each mode adds, as a share of a step's (forward + backward ~ 3 x forward): full runs every block's
    forward again, selective the ops it does not keep (counted as :mod:`torch.utils.flop_counter` does, at the
    captured size)."""
    forward = sum(mem.flops.get("forward", 0) for mem in none.values())
    again = {"none": 0, "selective": sum(mem.flops.get("selective", 0) for mem in none.values()),
             "full": sum(mem.flops.get("blocks", 0) for mem in none.values())}
    return {mode: (n / (3 * forward) if forward else 0.0) for mode, n in again.items()}


def _peak(row: dict, memory: dict, layout: Layout, pp_rank: int, m: int, at: dict,
          recompute_extra: sympy.Expr = sympy.Integer(0)) -> dict:
    """Model state + bytes held for backward x the microbatches the schedule keeps alive + the transient.

    Of the combinations {stage: microbatches alive} the schedule passes through (:mod:`fxshard.cost.alive`),
    the one holding the most bytes at ``at``.  The transient is an estimate: twice the largest value one
    microbatch's forward makes, for its backward holds that value's gradient next to the gradient of the
    op's input (of the same size for the elementwise ops and projections that make the largest values);
    what a gradient is made of beyond that is not modelled.  Under recompute, ``recompute_extra`` joins it: the
    block whose forward backward runs again."""
    counts = alive_counts(layout.schedule, layout.pp, m, layout.stages_per_rank)[pp_rank] if layout.pp > 1 \
        else [{0: 1}]
    held = max(((sum((c * memory[s].saved for s, c in v.items()), sympy.Integer(0)), v) for v in counts),
               key=lambda e: float(e[0].subs(at)))
    largest = max((memory[s] for s in memory), key=lambda mem: float(mem.largest.subs(at)))
    state = row["params_peak"].expr + row["grads"].expr + row["optimizer"].expr
    transient = sympy.expand(2 * largest.largest + recompute_extra)
    return {"saved": Cost(sum((mem.saved for mem in memory.values()), sympy.Integer(0)), at),
            "alive": Cost(sympy.Integer(sum(held[1].values())), at), "alive_by_stage": held[1],
            "activations": Cost(sympy.expand(held[0]), at), "transient": Cost(transient, at),
            "transient_node": largest.largest_node, "model_state": Cost(state, at),
            "peak": Cost(sympy.expand(state + held[0] + transient), at)}


def _block_params(state, ctx, layout: Layout) -> list[int]:
    """This rank's parameters per repeated block: the FSDP2 units of per-block ZeRO 3 (without the experts of
    ``--ep``, which FSDP2 leaves alone)."""
    blocks = find_blocks(ctx.program.module_types)
    fqns = ctx.program.state_by_name()
    per: dict[str, int] = {}
    for n in state:
        if n not in ctx.params or fqns[n.name].fqn in ctx.expert_params:
            continue
        block = next((b for b in (blocks.names if blocks else []) if under(fqns[n.name].fqn, b)), None)
        if block is not None:
            per[block] = per.get(block, 0) + math.prod(local_shape(tuple(n.meta["val"].shape), spec(n).placement,
                                                                   layout.tp))
    return list(per.values())


def _expert_psi(state, ctx, layout: Layout) -> int:
    """Parameters of this rank's experts (E/ep of each MoE layer's, as the expert-parallel pass shaped them)."""
    fqns = ctx.program.state_by_name()
    return sum(math.prod(local_shape(tuple(n.meta["val"].shape), spec(n).placement, layout.tp))
               for n in state if n in ctx.params and fqns[n.name].fqn in ctx.expert_params)


def _frozen_psi(state, ctx, layout: Layout) -> int:
    """Parameters of this rank that do not train (``requires_grad=False``; not the experts, counted on their own)."""
    fqns, trainable = ctx.program.state_by_name(), ctx.trainable
    return sum(math.prod(local_shape(tuple(n.meta["val"].shape), spec(n).placement, layout.tp))
               for n in state if n in ctx.params and n not in trainable and fqns[n.name].fqn not in ctx.expert_params)


def expert_state(layout: Layout, experts: int) -> dict[str, float]:
    """Bytes of the experts' model state on one rank (``experts``: their parameters on it, E/ep of each layer's).
    They are data-parallel over edp (dp/ep ranks holding the same experts), not dp: ZeRO 1 shards their Adam state
    over edp; under ZeRO 2/3 FSDP2 leaves them whole, so every category is whole (``fxshard.train.modules``)."""
    return formula(1 if layout.zero == 1 else 0, layout.size(EDP), layout.mixed, experts)


def _expert_dp_bytes(layout: Layout, experts: int) -> float:
    """Bytes a rank sends per step for the experts' gradients: an all-reduce over edp (``sync_expert_grads``),
    and at ZeRO 1 the broadcast of the updated parameters over edp."""
    if not experts or layout.size(EDP) == 1:
        return 0
    edp = dataclasses.replace(layout, dp=layout.size(EDP), ep=1, zero=1 if layout.zero == 1 else 0)
    return _dp_bytes(edp, experts)


def _all_to_all_bytes(tensors, numel, layout: Layout) -> sympy.Expr:
    """Bytes one microbatch's ep exchanges send from a rank, balanced routing: each all-to-all keeps 1/ep of its
    buffer (the rows for this rank's own experts) and sends the rest (:data:`fxshard.ir.comm.WIRE`).  The rows
    dispatched (tokens x top-k, H each) go out and come back forward, and again as gradients backward; the
    counts (E per layer, the offsets' dtype) forward only."""
    total = sympy.Integer(0)
    for n in tensors:
        kind = KINDS.get(spec(n).collective)
        if kind is None or not any(isinstance(a, Group) and a.axis == EP for a in n.args):
            continue
        times = sum(1 for d in ("forward", "backward") for op, _ in kind.ops(d) if op == "all_to_all")
        total += times * numel(n.args[0]) * n.args[0].meta["val"].element_size()
    return sympy.nsimplify(WIRE["all_to_all"](layout.ep)) * total


def _cp_bytes(nodes, numel, layout: Layout) -> sympy.Expr:
    """Bytes one microbatch's attention exchanges over cp send from a rank, forward and backward, by the ring
    algorithms' :data:`fxshard.ir.comm.WIRE`: allgather's gathers of K and V ((cp-1)/cp of the gathered buffer each
    way), ring's cp-1 steps (a K block and a V block each, forward, and their gradients back), a2a's all-to-alls."""
    total = sympy.Integer(0)
    for n in nodes:
        kind = KINDS.get(spec(n).collective)
        if kind is not None and kind.amaxes:  # fp8 linears under --cp: their amaxes over cp (x tp), float32
            total += _cp_amax_bytes(n, kind, numel, layout)
        if kind is None or not any(isinstance(a, Group) and a.axis == CP for a in n.args) or kind.amaxes:
            continue
        for direction in ("forward", "backward"):
            op = getattr(kind, direction)  # cp's kinds: one operation a direction, none of them fp8's
            if op is None:
                continue
            whole = n.args[0] if buffer_is_input(kind, direction) or op == "send_recv" else n
            size = numel(whole) * whole.meta["val"].element_size()
            total += sympy.nsimplify(WIRE[op](layout.cp)) * size
    return total


def _cp_amax_bytes(n: fx.Node, kind, numel, layout: Layout) -> sympy.Expr:
    """The bytes an fp8 call's amax all-reduces over cp (``cp``, or ``cp_tp`` with tp) send from a rank."""
    total = sympy.Integer(0)
    for direction in kind.amaxes:
        group = op_group(n.args, n.kwargs, True)
        if not isinstance(group, Group) or group.axis not in (CP, CPTP):
            continue
        elements = kind.buffer(numel(n.args[0]), [local_shape(tuple(w.meta["val"].shape), spec(w).placement, layout.tp)
                                                  for w in amax_weights(n.kwargs)], n.kwargs, direction)
        total += sympy.nsimplify(WIRE["all_reduce"](layout.size(group.axis))) * 4 * sympy.nsimplify(elements)
    return total


def _tp_elements(collectives, numel, tp: int) -> dict[str, sympy.Expr]:
    """Elements of the whole buffers the tp collectives of one microbatch move, by backend operation, forward
    and backward (:mod:`fxshard.ir.comm`): a reduction's input, a gather's output."""
    moved: dict[str, sympy.Expr] = {}
    for n in collectives:
        kind = KINDS.get(spec(n).collective)
        if kind is None:
            continue
        for direction in ("forward", "backward"):
            for op, amaxes in kind.ops(direction):
                group = op_group(n.args, n.kwargs, amaxes)
                if isinstance(group, Group) and group.axis != TP:  # ep, cp: their own rows
                    continue
                if amaxes:  # an fp8 call's amaxes (float32; counted as elements here)
                    moved[op] = moved.get(op, sympy.Integer(0)) + sympy.nsimplify(kind.buffer(
                        numel(n.args[0]), [local_shape(tuple(w.meta["val"].shape), spec(w).placement, tp)
                                           for w in amax_weights(n.kwargs)], n.kwargs, direction))
                else:
                    whole = numel(n.args[0]) if buffer_is_input(kind, direction) else numel(n)
                    moved[op] = moved.get(op, sympy.Integer(0)) + whole
    return moved


def _pipeline_elements(gm, stages, numel, ctx, m: int, layout: Layout) -> sympy.Expr:
    """Elements this rank sends per step: activations forward and their gradients backward, per boundary."""
    if ctx.pipeline is None:
        return sympy.Integer(0)
    grad = requires_grad(gm, ctx.trainable)
    total = sympy.Integer(0)
    for st in stages:
        if st.index < layout.num_stages - 1:  # forward: every output; backward: gradients of the received inputs
            total += sum((numel(n) for n in st.outputs), sympy.Integer(0))
        if st.index > 0:
            total += sum((numel(n) for n in st.inputs if n in grad), sympy.Integer(0))
    return sympy.expand(total * m)


def _dp_bytes(layout: Layout, psi: int, microbatches: int = 1, frozen: int = 0) -> float:
    """Bytes a rank sends per step over dp (ring collectives: each moves (N-1)/N of the buffer per pass), for
    ``psi`` trained parameters and ``frozen`` ones, which have no gradient and are not updated: only FSDP2's
    all-gathers (ZeRO 2/3) move them.

    ZeRO 3 under a pipeline schedule all-gathers each stage's parameters m + 1 times per step (measured
    for GPipe, 1F1B, interleaved 1F1B per stage: benchmarks/comm_axes.py); 2 without a pipeline.  FSDP2
    reshards after each forward; the backwards re-gather, the last one keeps them.  Not modelled: a rank
    with 4 or more stages, where torch's schedule evicts and re-gathers stages (``max_active_stages``)."""
    n = layout.replicas  # the ranks averaging gradients: dp, times cp under --cp
    if n == 1:
        return 0
    ring = (n - 1) / n
    low = 2 if layout.mixed else 4
    if layout.zero <= 1:  # ZeRO 0: all-reduce of the gradients (2 passes); ZeRO 1: reduce-scatter of the gradient
        return 2 * ring * low * psi  # buckets and all-gather of the parameter buckets (both in the compute dtype)
    gather = ring * low * (psi + frozen)  # all-gather of the parameters (compute dtype)
    reduce = ring * 4 * psi if layout.mixed else ring * low * psi  # reduce-scatter of gradients (fp32 under bf16)
    return reduce + gather * (1 if layout.zero == 2 else microbatches + 1)
