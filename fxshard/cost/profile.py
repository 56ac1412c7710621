"""The model as ``fxshard plan --auto`` sees it: one capture, each piece's costs as expressions in b, S and T.

A search over thousands of layouts cannot compile each one (a 70B shape compiles in minutes here), and it does
not need to: every layout runs the same pieces, the part before the repeated blocks, one block of each kind
times its count, the part after, differently split.  So the model is captured once, shortened to one block of
each distinct kind (blocks whose parameters have the same names and shapes are one kind: DeepSeek-V3's dense
and MoE layers are two), at two sizes to make shapes symbolic (:func:`fxshard.cost.costs._symbolic_shapes`),
and the passes run on copies of that capture at tp=1, at the smallest tp > 1 the model divides by, and at that tp
with ``--sp``.  Each node's local dimensions then follow ``b`` (microbatch rows), ``S`` (sequence) and ``T`` (tp):
a dimension tp splits at the compiled tp is split by ``T``.  Per piece, for each of the three structures:

- forward FLOPs by op class (matmul, attention, grouped expert matmuls, fp8 linears: :mod:`fxshard.cost.fp8`), as
  :mod:`torch.utils.flop_counter` counts them (``2·m·n·k``; attention ``2·b·h·s_q·s_k·(d_q+d_v)``), on the
  node's local symbolic shapes, and whether an attention is causal (``is_causal``: its kernel computes only the
  scores at or below the diagonal); and the bytes every other op reads and writes (views move nothing);
- the tp collectives of one microbatch, forward and backward, with the weight-gradient matmuls a fused
  ``copy_to_linears`` overlaps its all-reduce with (:mod:`fxshard.ir.comm`);
- the bytes autograd saves per recompute mode (:mod:`fxshard.cost.saved`, the plan's own trace), the values that
  bound the transient, the parameters (the experts apart), what a pipeline stage boundary sends.

The time model (:mod:`fxshard.cost.timemodel`) turns these into a step for any layout::

    profile = model_profile("samples/llama70b.py", dtype="bf16")
    profile.pieces("tp")["block0"].flops["matmul"]       # 2*b*S*... / T
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
import torch.fx as fx

from fxshard.cost.costs import RECOMPUTE_ORDER, S, _b, _capture_second, _symbolic_shapes, _traces
from fxshard.cost.fp8 import CAST_KERNELS, FP8_TARGETS, amax_bytes, fp8_costs, fp8_product_costs
from fxshard.errors import LayoutError, ShardingError
from fxshard.graph import loss_cone
from fxshard.ir.comm import FUSED_LINEARS, KINDS, buffer_is_input, op_group
from fxshard.ir.context import Group, spec
from fxshard.ir.cut import find_blocks
from fxshard.ir.experts import grouped_mm_ops, weight_param
from fxshard.ir.layout import TP, Coords, Layout
from fxshard.ir.placement import Shard
from fxshard.ir.sharding import argument
from fxshard.runtime import activations as rta
from fxshard.runtime import fp8 as rt_fp8

b, T = _b, sympy.Symbol("T", positive=True, integer=True)
aten = torch.ops.aten
STRUCTURES = ("tp1", "tp", "sp")  # tp=1; tp > 1; tp > 1 with --sp
_ATTENTION = {aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention.default,
              aten._scaled_dot_product_efficient_attention.default,
              aten._scaled_dot_product_flash_attention_for_cpu.default}
_MATMUL = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
           aten.baddbmm.default}


@dataclass(frozen=True)
class Comm:
    """One backend collective of one microbatch: ``op`` over ``axis``, ``nbytes`` the whole buffer (an expression),
    ``direction`` forward or backward; ``overlap`` the FLOPs it runs beside (the weight gradients of a fused
    ``copy_to_linears``), 0 when it blocks."""

    op: str
    axis: str
    direction: str
    nbytes: sympy.Expr
    overlap: sympy.Expr = sympy.Integer(0)
    amaxes: bool = False  # an fp8 call's amaxes: under --cp all-reduced over cp x tp (the time model prices so)


@dataclass
class Piece:
    """What one microbatch's forward runs of one piece, on one rank (expressions in b, S, T)."""

    name: str
    flops: dict[str, sympy.Expr] = field(default_factory=dict)  # matmul, attention, grouped
    # (class, FLOPs, bytes read + written, causal) per matmul-like op; causal: an attention whose kernel skips the
    # scores above the diagonal (the FLOPs stay flop_counter's count, which has all of them)
    ops: list[tuple] = field(default_factory=list)
    traffic: sympy.Expr = sympy.Integer(0)  # bytes read + written by the other ops
    kernels: int = 0
    # an fp8 linear's casts (fxshard.cost.fp8), bytes read + written: forward's (input, weight), backward's (the
    # output gradient twice, the input and weight again); memory-bound, and not run again by selective recompute
    casts: sympy.Expr = sympy.Integer(0)
    casts_bwd: sympy.Expr = sympy.Integer(0)
    # what backward runs again of the ops fxshard.runtime.activations keeps less for (their forward ops, memory-bound)
    redo_traffic: sympy.Expr = sympy.Integer(0)
    redo_kernels: int = 0
    comms: list[Comm] = field(default_factory=list)
    saved: dict[str, sympy.Expr] = field(default_factory=dict)  # recompute mode -> bytes kept for backward
    largest: list[sympy.Expr] = field(default_factory=list)  # candidate largest values (the transient)
    params: sympy.Expr = sympy.Integer(0)  # trained parameters on one tp rank, the experts apart
    frozen: sympy.Expr = sympy.Integer(0)  # parameters that do not train (requires_grad=False): held, never reduced
    experts: sympy.Expr = sympy.Integer(0)  # expert parameters (all E of each layer), on one tp rank
    dispatched: sympy.Expr = sympy.Integer(0)  # bytes of the rows a MoE layer sends its experts (ep all-to-all)
    kv: sympy.Expr = sympy.Integer(0)  # bytes of attention's keys and values (cp exchanges them)
    boundary: sympy.Expr = sympy.Integer(0)  # bytes a pipeline stage starting with this block receives
    boundary_grad: sympy.Expr = sympy.Integer(0)  # ... and sends back as gradients
    tied: sympy.Expr = sympy.Integer(0)  # parameters an earlier piece holds that this one reads too (a tied
    # embedding and LM head): a pipeline holds them on both stages and all-reduces their gradient


@dataclass
class ModelProfile:
    model: str
    dtype: str
    kinds: list[str]  # the full model's blocks, in order, by kind ("block0", "block1", ...)
    structures: dict[str, dict[str, Piece]]  # structure -> piece name -> Piece
    tp_sizes: list[sympy.Expr]  # dimensions tp splits (with their blocks), checked for each tp
    sp_sizes: list[sympy.Expr]  # ... and under --sp
    example: dict  # b0, S0: the sizes captured
    parameters: int  # the whole model's parameters
    notes: list[str] = field(default_factory=list)
    compiled_tp: int = 2
    experts: int = 0  # experts per MoE layer (0: no MoE layer)
    batch: int = 1  # the example's rows (the default global batch)

    def pieces(self, structure: str) -> dict[str, Piece]:
        return self.structures[structure]

    def valid_tp(self, tp: int, sp: bool, at: dict) -> str | None:
        """Why ``tp`` (with ``sp``) does not divide the model at sizes ``at``; None when it does."""
        if tp == 1:
            return None
        if "tp" not in self.structures:
            return "the model has no dimension tp splits (its plan shards nothing)"
        for size in self.tp_sizes + (self.sp_sizes if sp else []):
            value = size.subs(at)
            if not value.is_number or int(value) % tp:
                return f"a dimension of {int(value) if value.is_number else value} does not divide by tp={tp}"
        return None


def shorten(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str], list[str]]:
    """``model`` with its repeated blocks cut to one of each kind, in place: (model, the full model's kinds in order,
    the kinds of the blocks kept).  Should another run of modules outnumber the one block kept (so the compiler
    would take that run for the blocks), more blocks of the first kind are kept, and their costs averaged."""
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    blocks = find_blocks(types)
    if blocks is None:
        return model, [], []
    container = model.get_submodule(blocks.prefix)
    signature: dict[tuple, str] = {}
    kinds, keep, kept = [], [], []
    for block in container:
        sig = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()) + \
            tuple(type(m).__name__ for m in block.modules())
        if sig not in signature:
            signature[sig] = f"block{len(signature)}"
            keep.append(block)
            kept.append(signature[sig])
        kinds.append(signature[sig])
    parent, _, attr = blocks.prefix.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    extra = [b for b, k in zip(container, kinds, strict=True) if k == "block0"][1:]
    while True:
        setattr(owner, attr, type(container)(keep))
        found = find_blocks({n: type(m).__name__ for n, m in model.named_modules()})
        if (found and found.prefix == blocks.prefix) or not extra:
            return model, kinds, kept
        keep.insert(kept.count("block0"), extra.pop(0))
        kept.insert(kept.count("block0"), "block0")


def model_profile(model_file: str | Path, dtype: str = "bf16", seed: int = 0, plan: dict | None = None) -> ModelProfile:
    """Capture ``model_file`` once (shortened, at two sizes) and cost its pieces under each structure."""
    from fxshard.capture.modelfile import load_model_file
    from fxshard.capture.precision import capture_at

    mf = load_model_file(model_file)
    kinds: list[str] = []
    kept: list[str] = []
    parameters: list[int] = []

    def make_model():
        model = mf.make_model()
        parameters.append(sum(p.numel() for p in model.parameters()))
        short, found, kept[:] = shorten(model)
        kinds[:] = found
        return short

    short_mf = dataclasses.replace(mf, make_model=make_model)
    short_mf.build_model(seed, meta=True)  # kinds, kept, parameters (on meta: free); a capture may come from cache
    full = mf.build_inputs(seed)
    inputs = _example(full)
    low = Layout(dtype=dtype)
    program = capture_at(short_mf, seed, inputs, low.compute_dtype if low.mixed else None, meta=True)
    b0, s0 = _sizes(inputs)
    s2 = (s0 * 3 // 4 if s0 % 4 == 0 else s0 - 1) if s0 and s0 > 2 else s0
    second = _capture_second(short_mf, low, seed, b0, s0, s2, [])
    profile = ModelProfile(str(model_file), dtype, kinds, {}, [], [], {b: b0, S: s0 or 1, T: 1}, parameters[0],
                           batch=_sizes(full)[0])
    for structure, layout in _structure_layouts(short_mf, program, dtype, plan, seed):
        result, t0 = layout
        _cost_structure(profile, structure, result, t0, second, b0, s0, kept)
    return profile


def _example(inputs):
    """The example batch cut to 2 rows: one microbatch of the search's b (at 1, export would specialize)."""
    return torch.utils._pytree.tree_map(lambda v: v[:2].clone() if isinstance(v, torch.Tensor) and v.dim() else v,
                                        inputs)


def _sizes(inputs) -> tuple[int, int | None]:
    leaves = [v for v in torch.utils._pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor) and v.dim()]
    b0 = leaves[0].shape[0] if leaves else 1
    s0 = next((v.shape[1] for v in leaves if v.dim() >= 2), None)
    return b0, s0


def _structure_layouts(mf, program, dtype, plan, seed):
    """(structure, (compiled program, its tp)) for tp=1, the smallest tp > 1 that divides, and that tp with --sp."""
    from fxshard.compiler import compile_program

    def compiled(layout):
        return compile_program(mf, layout, plan, seed, program=_copy_program(program))

    yield "tp1", (compiled(Layout(dtype=dtype)), 1)
    for t0 in (2, 3, 4, 5, 6, 7, 8):
        try:
            result = compiled(Layout(tp=t0, dtype=dtype))
        except (LayoutError, ShardingError):
            continue
        yield "tp", (result, t0)
        try:
            yield "sp", (compiled(Layout(tp=t0, dtype=dtype, sp=True)), t0)
        except (LayoutError, ShardingError):
            pass
        return


def _copy_program(program):
    """A program the passes may rewrite, the capture kept for the next structure (the model and tensors shared)."""
    clone = copy.copy(program)
    clone.gm = fx.GraphModule(program.gm, copy.deepcopy(program.gm.graph))
    for old, new in zip(program.gm.graph.nodes, clone.gm.graph.nodes, strict=True):
        new.meta = dict(old.meta)
    return clone


def _cost_structure(profile: ModelProfile, structure: str, result, t0: int, second, b0: int, s0,
                    kept: list[str]) -> None:
    from fxshard.ir.fake import local_value_shapes

    ctx, gm = result.ctx, result.gm
    state = {n for n in gm.graph.nodes if n.op == "placeholder" and n not in ctx.user_inputs}
    sym, notes = _symbolic_shapes(None, ctx.layout, 0, gm, b0, s0, state, second=second)
    profile.notes.extend(n for n in notes if n not in profile.notes)
    local = local_value_shapes(gm, ctx, Coords())

    def dims(node) -> tuple:
        g = tuple(node.meta["val"].shape)
        mine = local.get(node, g)
        return tuple(e if m == d else e * sympy.Rational(m * t0, d) / T for e, m, d in zip(sym[node.name], mine, g,
                                                                                             strict=True))

    cone = loss_cone(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n in cone]
    piece_of = _piece_names(nodes, kept)
    pieces = {name: Piece(name) for name in dict.fromkeys(piece_of.values())}
    for node in nodes:
        _cost_node(node, pieces[piece_of[node]], dims)
    _cost_state(gm, ctx, nodes, piece_of, pieces, dims, profile, structure)
    _cost_saved(gm, ctx, nodes, piece_of, pieces, local, dims, {b: b0, S: s0 or 1, T: t0})
    _cost_boundaries(ctx, gm, nodes, pieces, piece_of, dims)
    for kind in set(kept):
        _average(pieces[kind], kept.count(kind))
    if structure != "tp1":
        sizes = _split_sizes(gm, sym)
        profile.compiled_tp = t0
        if structure == "tp":
            profile.tp_sizes = sizes
        else:
            profile.sp_sizes = [s for s in sizes if s.free_symbols]
    profile.structures[structure] = pieces


def _piece_names(nodes: list[fx.Node], kept: list[str]) -> dict[fx.Node, str]:
    """Node -> its piece: ``before`` the blocks, the kind of the (shortened model's) block it runs in, ``after``."""
    order = list(dict.fromkeys(spec(n).block for n in nodes if spec(n).block))
    kind_of = {name: kept[i] if i < len(kept) else "block0" for i, name in enumerate(order)}
    out, seen_block = {}, False
    for n in nodes:
        block = spec(n).block
        if block:
            seen_block = True
            out[n] = kind_of.get(block, "block0")
        else:
            out[n] = "after" if seen_block else "before"
    return out


def _cost_node(node: fx.Node, piece: Piece, dims) -> None:
    """FLOPs (flop_counter's formulas on the local symbolic shapes), memory traffic and collectives of one node."""
    kind = KINDS.get(spec(node).collective)
    if kind is not None and kind.communicates:
        _collectives(node, kind, piece, dims)
    if node.target is rt_fp8.fp8_linears_regathered:  # each product as an fp8 linear's; the input cast once
        x = node.args[0]
        for i, (u, w) in enumerate(zip(sorted((u for u in node.users if isinstance(u.meta.get("val"), torch.Tensor)),
                                              key=lambda u: u.args[1]), node.kwargs["weights"], strict=False)):
            flops, mm, casts, casts_bwd, copies = fp8_product_costs(x, w, u, dims, input_cast=i == 0)
            _add_op(piece, "fp8", flops, mm)
            piece.casts += casts
            piece.casts_bwd += casts_bwd
            piece.kernels += CAST_KERNELS if i == 0 else CAST_KERNELS // 2
            _note_value(piece, u, dims)
            piece.largest += [copies] if copies not in piece.largest else []
        return
    if node.target in FUSED_LINEARS:
        x = node.args[0]
        for u, w in zip(sorted((u for u in node.users if isinstance(u.meta.get("val"), torch.Tensor)),
                               key=lambda u: u.args[1]), node.kwargs["weights"], strict=False):
            _add_op(piece, "matmul", 2 * _numel(dims(u)) * dims(x)[-1], _nbytes(x, dims) + _nbytes(w, dims) +
                    _nbytes(u, dims))
            _note_value(piece, u, dims)
        return
    if node.target in _ACTIVATION_OPS:  # the ATen ops it stands for, forward; what backward runs of them again
        traffic, kernels, redo, redo_kernels = _ACTIVATION_OPS[node.target](node, dims)
        piece.traffic += traffic
        piece.kernels += kernels
        piece.redo_traffic += redo
        piece.redo_kernels += redo_kernels
        _note_value(piece, node, dims)
        return
    if node.target in FP8_TARGETS:  # --dtype fp8: the product at the fp8 peak, the casts memory-bound
        flops, mm, casts, casts_bwd, copies = fp8_costs(node, dims)
        _add_op(piece, "fp8", flops, mm)
        piece.casts += casts
        piece.casts_bwd += casts_bwd
        piece.kernels += CAST_KERNELS
        _note_value(piece, node, dims)
        piece.largest += [copies] if copies not in piece.largest else []
        return
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or _is_view(node):
        return
    flops = _flops(node, dims)
    if flops is not None:
        cls, n = flops
        ins = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        _add_op(piece, cls, n, sum((_nbytes(a, dims) for a in ins), _nbytes(node, dims)),
                cls == "attention" and bool(argument(node, "is_causal", False)))
        _note_value(piece, node, dims)
        if cls == "attention":
            piece.kv += sum((_nbytes(a, dims) for a in node.args[1:3]), sympy.Integer(0))
        if cls == "grouped" and _is_first_grouped(node):
            piece.dispatched += _nbytes(node.args[0], dims)
        return
    piece.kernels += 1
    ins = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    piece.traffic += sum((_nbytes(a, dims) for a in ins), _nbytes(node, dims))
    _note_value(piece, node, dims)


def _silu_mul_costs(node: fx.Node, dims) -> tuple:
    """silu (gate in, silu out) and mul (silu and up in, the product out): 5 values of the product's size, 2 kernels;
    backward runs silu again."""
    n = _nbytes(node, dims)
    return 5 * n, 2, 2 * n, 1


def _rms_normalize_costs(node: fx.Node, dims) -> tuple:
    """to (x in, x32 out), pow (x32 in and out), mean (x32 in), add and rsqrt (one value a row), mul (x32 in and
    out): x's bytes and 6 of x32's (the fp32 output's size), 6 kernels; backward runs them all again."""
    out, x = _nbytes(node, dims), _nbytes(node.args[0], dims)
    return x + 6 * out, 6, x + 6 * out, 6


_ACTIVATION_OPS = {rta.silu_mul: _silu_mul_costs, rta.rms_normalize: _rms_normalize_costs}


def _note_value(piece: Piece, node: fx.Node, dims) -> None:
    """A floating value the forward makes: twice the largest is the plan's transient."""
    if node.meta["val"].is_floating_point():
        expr = _nbytes(node, dims)
        if expr not in piece.largest:
            piece.largest.append(expr)


def _add_op(piece: Piece, cls: str, flops: sympy.Expr, nbytes: sympy.Expr, causal: bool = False) -> None:
    piece.flops[cls] = piece.flops.get(cls, 0) + flops
    piece.ops.append((cls, flops, nbytes, causal))
    piece.kernels += 1


def _flops(node: fx.Node, dims) -> tuple[str, sympy.Expr] | None:
    """(class, forward FLOPs) of a matmul, attention or grouped expert matmul node, as torch's flop counter has it."""
    if node.target in _MATMUL:
        a = node.args[1] if node.target in (aten.addmm.default, aten.baddbmm.default) else node.args[0]
        return "matmul", 2 * _numel(dims(node)) * dims(a)[-1]
    if node.target in grouped_mm_ops():
        return "grouped", 2 * _numel(dims(node)) * dims(node.args[0])[-1]
    if node.target in _ATTENTION:
        q, k, v = (dims(a) for a in node.args[:3])
        return "attention", 2 * _numel(q[:-1]) * k[-2] * (q[-1] + v[-1])
    return None


def _is_first_grouped(node: fx.Node) -> bool:
    """The first of an experts module's two grouped matmuls (its input is the dispatched rows)."""
    return not any(a.target in grouped_mm_ops() for a in _ancestors(node.args[0], 6))


def _ancestors(node, depth: int):
    if depth == 0 or not isinstance(node, fx.Node):
        return []
    return [node] + [x for a in node.all_input_nodes for x in _ancestors(a, depth - 1)]


def _collectives(node: fx.Node, kind, piece: Piece, dims) -> None:
    groups = [a for a in node.args if isinstance(a, Group)] + [a for a in node.kwargs.values() if isinstance(a, Group)]
    axis = groups[0].axis if groups else TP
    for direction in ("forward", "backward"):
        for op, amaxes in kind.ops(direction):
            if amaxes:  # an fp8 call's amaxes (under --cp over cp x tp: the time model prices them so)
                group = op_group(node.args, node.kwargs, True)
                piece.comms.append(Comm(op, group.axis if isinstance(group, Group) else axis, direction,
                                        amax_bytes(node, dims, direction), sympy.Integer(0), amaxes=True))
                continue
            buffer = node.args[0] if buffer_is_input(kind, direction) else node
            if not isinstance(buffer.meta.get("val"), torch.Tensor):
                buffer = node.args[0]
            overlap = sympy.Integer(0)
            if node.target in FUSED_LINEARS and direction == "backward":  # beside the input gradient's matmuls
                x = node.args[0]
                overlap = sum((2 * _numel(dims(u)) * dims(x)[-1] for u in node.users
                               if isinstance(u.meta.get("val"), torch.Tensor)), sympy.Integer(0))
            piece.comms.append(Comm(op, axis, direction, _nbytes(buffer, dims), overlap))


def _cost_state(gm, ctx, nodes, piece_of, pieces, dims, profile: ModelProfile, structure: str) -> None:
    """Each parameter on the piece that first reads it; the experts' apart, the frozen ones (``requires_grad=False``:
    no gradient, no optimizer state) apart; weights read before and after the blocks (tied) are counted once here
    and noted, as a pipeline holds them on two stages."""
    experts, trainable = set(), ctx.trainable
    for n in nodes:
        if n.target in grouped_mm_ops():
            param, _ = weight_param(n.args[1], ctx.params)
            if param is not None:
                experts.add(param)
                profile.experts = int(param.meta["val"].shape[0])
    for p in (n for n in gm.graph.nodes if n.op == "placeholder" and n in ctx.params):
        users = [u for u in _consumers(p) if u in piece_of]
        if not users:
            continue
        where = {piece_of[u] for u in users}
        numel = _numel(dims(p))
        piece = pieces[piece_of[users[0]]]
        if p in experts:
            piece.experts += numel
        elif p not in trainable:
            piece.frozen += numel
        else:
            piece.params += numel
        if {"before", "after"} <= where:
            pieces["after"].tied += numel


def _consumers(node: fx.Node) -> list[fx.Node]:
    """The compute nodes reading ``node``, through the views and casts on its way."""
    out = []
    for u in node.users:
        if u.op == "call_function" and (_is_view(u) or u.target is aten.to.dtype) and not spec(u).block:
            out += _consumers(u) or [u]
        else:
            out.append(u)
    return out


def _cost_saved(gm, ctx, nodes, piece_of, pieces, local, dims, at) -> None:
    """Bytes kept for backward per piece and recompute mode: the plan's trace (:mod:`fxshard.cost.saved`)."""
    state = [n for n in gm.graph.nodes if n.op == "placeholder" and n in ctx.params]
    traces = _traces(gm, ctx, [], nodes, state, Coords(), local, dims, at)
    block_piece = {spec(n).block: piece_of[n] for n in nodes if spec(n).block}
    name_piece = {n.name: piece_of[n] for n in nodes}
    for mode in RECOMPUTE_ORDER:
        memory = traces.get(mode, traces["none"])[0]
        for piece in pieces.values():
            piece.saved[mode] = sympy.Integer(0)
        for key, expr in memory.saved_by.items():
            name = block_piece.get(key) or name_piece.get(key, "after")
            pieces[name].saved[mode] += expr


def _average(piece: Piece, n: int) -> None:
    """A kind traced in ``n`` blocks: its piece holds one block's costs."""
    if n <= 1:
        return
    piece.flops = {k: sympy.expand(v / n) for k, v in piece.flops.items()}
    piece.saved = {k: sympy.expand(v / n) for k, v in piece.saved.items()}
    piece.comms = piece.comms[:len(piece.comms) // n]
    piece.ops = piece.ops[:len(piece.ops) // n]
    for name in ("traffic", "casts", "casts_bwd", "redo_traffic", "params", "frozen", "experts", "dispatched", "kv"):
        setattr(piece, name, sympy.expand(getattr(piece, name) / n))
    piece.kernels //= n
    piece.redo_kernels //= n


def _cost_boundaries(ctx, gm, nodes, pieces, piece_of, dims) -> None:
    """What a pipeline stage that starts at a block receives and sends back as gradients: the block's inputs that
    carry a gradient (the hidden states); what depends on the batch alone (masks, rotary tables) the pipeline
    pass recomputes in the stage or forwards once, small beside them."""
    from fxshard.ir.autograd import requires_grad
    from fxshard.ir.blocks import block_units, bodies

    grad = requires_grad(gm, ctx.params)
    body = bodies(gm, ctx)[0]
    units = block_units(body.nodes, body.state, body.keep, body.apart)
    for unit in units.values():
        piece = pieces[piece_of[unit.nodes[0]]]
        if piece.boundary != 0:
            continue
        sent = [a for a in unit.inputs if a in grad and a not in ctx.params]
        piece.boundary = piece.boundary_grad = sum((_nbytes(a, dims) for a in sent), sympy.Integer(0))


def _split_sizes(gm, sym) -> list[sympy.Expr]:
    """The global sizes tp splits (each times its blocks: a packed q/k/v splits each third)."""
    sizes = set()
    for n in gm.graph.nodes:
        p = spec(n).placement
        if isinstance(p, Shard) and n.name in sym and p.dim < len(sym[n.name]):
            sizes.add(sympy.expand(sym[n.name][p.dim] / p.blocks))
    return sorted(sizes, key=str)


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.target is __import__("operator").getitem
    return bool(schema.returns) and schema.returns[0].alias_info is not None and not schema.is_mutable


def _numel(shape) -> sympy.Expr:
    return sympy.expand(math.prod(shape, start=sympy.Integer(1)))


def _nbytes(node, dims) -> sympy.Expr:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return sympy.Integer(0)
    return _numel(dims(node)) * val.element_size()
