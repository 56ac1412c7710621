"""The time model: one training step of a layout on a hardware profile, from the model's pieces.

Compute: each piece's matmul, attention and expert FLOPs at the device's peak for the compute dtype (an fp8 linear's at
the fp8 peak: :mod:`fxshard.cost.fp8`) times the op class's efficiency, each op no faster than its bytes at the memory
bandwidth (a roofline, op by op), and the other ops' bytes at the memory bandwidth, all times the profile's
``compute_scale`` (1 on the shipped profiles; ``fxshard calibrate --model`` measures a model's step against this
roofline); backward is twice the forward (attention 2.5 times: five matmuls to two, as :mod:`torch.utils.flop_counter`
counts them); recompute runs a block's forward again (``full``) or its memory-bound ops plus the selective policy's cost
per op (``selective``, :func:`selective_redo`), with its tp collectives.  Under ``fp8`` (an Evaluator's dtype: bf16 with
float8 products) the matmuls run at the fp8 peak and each pass pays its operands' dynamic casts
(:func:`fp8_cast_seconds`).

Communication, at the link each axis lands on (within a node or across nodes, from the mesh order dp, cp, pp, tp
and the devices per node): each collective by the ring formula (bandwidth) plus a ring or tree latency
(:meth:`Hardware.collective_seconds`).  What the runtime overlaps is subtracted where it overlaps:

- tp: forward all-reduces block; a fused ``copy_to_linears`` backward all-reduces the input gradient while the
  weight gradients compute (``all-reduce - overlap x min(all-reduce, weight-gradient matmuls)`` is exposed, the
  profile's ``overlap`` the share of communication hidden beside compute: 1 on a GPU, measured on a CPU, whose
  cores the collective's copies and sums share with the compute; :meth:`Hardware.exposed`, used for every
  overlap below);
- dp: DDP's bucketed all-reduce runs during the (last) backward, its last bucket after it; ZeRO 1 reduce-scatters
  once after backward and all-gathers the parameters during the next forward (``gather_before_use``); ZeRO 2
  (FSDP2, one unit per stage module) gathers before the first forward and reduce-scatters after the last
  backward; ZeRO 3 gathers block by block, each prefetched during the block before, ``m + 1`` times a step;
- cp (once ``Layout`` has it): all-gather of keys and values forward, reduce-scatter of their gradients backward;
  ``ring``: the cp - 1 sends of each step overlap that step's attention; ep: the all-to-alls block.

Pipeline: each stage's forward and backward per microbatch (compute + exposed communication) are the durations of
torch's schedule actions, simulated (:mod:`fxshard.cost.pipesim`); what that leaves the critical rank idle is
the stage imbalance (the busiest rank's work beyond the critical rank's) and the bubble (the rest: fill and
drain, about ``(pp - 1)/(vp·m)`` of the work on even stages).  The terms add up to the step.  Memory
is the plan's: the ZeRO formulas (:mod:`fxshard.cost.zero_memory`), bytes saved per microbatch times the
microbatches torch's order keeps alive (:mod:`fxshard.cost.alive`), and the transient.

    ev = Evaluator(model_profile("samples/llama70b.py"), load_hardware("h100"))
    p = predict(ev, Layout(tp=8, pp=4, dp=2, dtype="bf16", microbatches=64), Setting(4096, 512, 8))
    p.step, p.tokens_per_s, p.mfu, p.fits
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import sympy

from fxshard.cost.alive import alive_counts
from fxshard.cost.hardware import Hardware
from fxshard.cost.pipesim import capped_microbatches, pipeline_step
from fxshard.cost.profile import ModelProfile, Piece, S, T, b
from fxshard.cost.zero_memory import formula, peak_params
from fxshard.ir.cut import balance
from fxshard.ir.layout import EDP, Layout

BACKWARD = {"matmul": 2.0, "grouped": 2.0, "attention": 2.5, "fp8": 2.0}  # backward FLOPs per forward FLOP
OPTIMIZER_BYTES = 28  # AdamW per parameter of the shard: master, gradient, two moments read; three written, a copy
FP8_CAST_BYTES = 2.5  # a dynamic float8 cast per bf16 byte: read for the amax, read again, write half the bytes
DDP_BUCKET = 25 * 2**20  # the last bucket DDP reduces after backward (fxshard.runtime.data_parallel)
# what a rank's predicted peak is made of: the model state (the experts' apart), what backward keeps of the
# microbatches alive, the transient (twice the largest value), the block recompute runs again
MEMORY_TERMS = ("parameters", "gradients", "optimizer", "experts", "activations", "transient", "recompute")


@dataclass(frozen=True)
class Setting:
    seq: int
    global_batch: int
    gpus_per_node: int


@dataclass(frozen=True)
class PieceCost:
    """One microbatch through one piece on one rank: seconds and bytes."""

    fwd: float
    bwd: float
    wgrad: float  # the weight-gradient share of bwd (a split backward's W)
    redo: dict  # recompute mode -> forward seconds backward runs again
    tp_fwd: float
    tp_bwd: float
    tp_redo: float  # forward collectives a recompute runs again
    saved: dict
    largest: float
    params: float  # trained
    frozen: float  # requires_grad=False: held (and gathered under FSDP2), no gradient, no optimizer state
    experts: float
    tied: float
    boundary: float
    boundary_grad: float
    kv: float
    dispatched: float
    flops: float  # forward FLOPs (matmul, attention, experts)
    attention: float  # seconds of attention forward (what a cp ring overlaps)


@dataclass
class Prediction:
    layout: Layout
    rows: int  # microbatch rows
    microbatches: int
    stages: list  # per stage: its pieces, e.g. ["before", "block0 x10"]
    step: float = 0.0
    compute: float = 0.0  # busy compute of the critical rank (recompute included)
    exposed: dict = field(default_factory=dict)  # axis -> exposed communication seconds on the critical rank
    bubble: float = 0.0  # the critical rank idle in the schedule's fill and drain
    # ... and idle waiting for a busier rank: the busiest rank's work (compute and exposed communication) beyond its
    # own (stages of unequal work: 61 layers over 32 stages); the bubble and the imbalance are the rank's idle time
    imbalance: float = 0.0
    terms: dict = field(default_factory=dict)  # what the step is made of, for comparisons
    tokens_per_s: float = 0.0  # per device
    mfu: float = 0.0
    peaks: list = field(default_factory=list)  # predicted peak bytes per pp rank
    memory: int = 0
    notes: list = field(default_factory=list)
    accumulate: int = 1  # pp=1: batches accumulated per step (fxshard run --grad-accum)
    memory_terms: list = field(default_factory=list)  # per pp rank: its peak as MEMORY_TERMS -> bytes

    @property
    def peak(self) -> float:
        return max(self.peaks)

    @property
    def fits(self) -> bool:
        return self.peak <= self.memory


class Evaluator:
    """A model profile on a hardware profile: piece costs by (structure, rows, sequence, tp, cp), cached."""

    def __init__(self, profile: ModelProfile, hw: Hardware, dtype: str | None = None):
        self.profile, self.hw = profile, hw
        dtype = dtype or profile.dtype
        # fp8: bf16 mixed precision whose matmuls take float8 operands (--dtype fp8): those run at the fp8 peak
        # and pay their operands' casts (FP8_CAST_BYTES); attention and every other op stay bf16.  A profile of
        # a program compiled at --dtype fp8 holds its fp8 linears as ops of their own (class "fp8",
        # fxshard.cost.fp8, casts counted in its traffic): only a bf16 profile evaluated as fp8 is emulated here
        self.fp8 = dtype == "fp8" and profile.dtype != "fp8"
        self.dtype = "bf16" if dtype == "fp8" else dtype
        self.peak = hw.peak(self.dtype)
        self.matmul_peak = hw.fp8_peak() if self.fp8 else self.peak
        self._fns = {(st, name): _compile(piece) for st, pieces in profile.structures.items()
                     for name, piece in pieces.items()}
        self.piece = functools.lru_cache(maxsize=None)(self._piece)
        self.stage_split = functools.lru_cache(maxsize=None)(self._stage_split)

    def _piece(self, structure: str, name: str, rows: int, seq: int, tp: int, cp: int, spread: int,
               spread_cptp: int = 1) -> PieceCost:
        values = _values(self._fns[(structure, name)], rows, seq, tp, cp)
        hw, eff = self.hw, self.hw.efficiency
        ops = values["ops"]
        k = hw.compute_scale  # the op mix of a measured step over the roofline's prediction of it (calibrate --model)
        t_ops = {c: k * sum(self._op_seconds(cc, f, by, causal, seq) for cc, f, by, causal in ops if cc == c)
                 for c in BACKWARD}
        t_mem = k * (values["traffic"] / (hw.memory_bandwidth * eff["memory"]) + values["kernels"] * hw.kernel_overhead)
        t_cast = k * fp8_cast_seconds(ops, hw) if self.fp8 else 0.0  # forward's casts, and backward's again
        rate = hw.memory_bandwidth * eff["memory"]  # a compiled fp8 linear's casts, each way (fxshard.cost.fp8)
        t_cast_fwd, t_cast_bwd = t_cast + k * values["casts"] / rate, t_cast + k * values["casts_bwd"] / rate
        fwd = sum(t_ops.values()) + t_mem + t_cast_fwd
        t_redo = k * (values["redo_traffic"] / (hw.memory_bandwidth * eff["memory"])
                      + values["redo_kernels"] * hw.kernel_overhead)  # fxshard.runtime.activations' ops again
        bwd = sum(BACKWARD[c] * t for c, t in t_ops.items()) + 2 * t_mem + t_cast_bwd + t_redo
        tp_fwd = tp_bwd = 0.0
        comms = list(values["comms"])
        if cp > 1 and tp == 1 and not self.fp8:  # --cp: each fp8 linear's amaxes all-reduced over cp (tensorwise:
            # the input's and the weight's forward, the gradient's backward), which a tp=1 profile has no call for
            comms += [("all_reduce", "cp", d, n, 0.0, True) for c, *_ in ops if c == "fp8"
                      for d, n in (("forward", 8), ("backward", 4))]
        for op, axis, direction, nbytes, overlap, amaxes in comms:
            if amaxes and cp > 1:  # --cp: the amaxes span cp's tokens, over cp x tp (counted with tp's exposure)
                t = hw.collective_seconds(op, nbytes, tp * cp, spread_cptp)
            elif axis != "tp" or tp == 1:
                continue
            else:
                t = hw.collective_seconds(op, nbytes, tp, spread)
            if direction == "forward":
                tp_fwd += t
            else:
                tp_bwd += hw.exposed(t, k * overlap / (self.matmul_peak * eff["matmul"]))
        flops = sum(op[1] for op in ops)
        redo = {"none": 0.0, "selective": selective_redo(t_mem, values["kernels"], hw), "full": fwd}
        return PieceCost(fwd, bwd, t_ops["matmul"] + t_ops["grouped"] + t_ops["fp8"], redo,
                         tp_fwd, tp_bwd, tp_fwd, values["saved"], values["largest"], values["params"], values["frozen"],
                         values["experts"], values["tied"], values["boundary"], values["boundary_grad"], values["kv"],
                         values["dispatched"], flops, t_ops["attention"])

    def _op_seconds(self, cls: str, flops: float, nbytes: float, causal: bool, seq: int) -> float:
        """One matmul-like op at the roofline: the FLOPs its kernel executes at the peak times its class's
        efficiency (attention's by sequence length where the profile has a curve, :meth:`Hardware.attention_efficiency`;
        a causal attention executes :func:`causal_share` of the scores flop_counter counts), or its bytes at the
        memory bandwidth, whichever takes longer."""
        hw = self.hw
        if cls == "attention":
            work, rate = flops * (causal_share(seq) if causal else 1.0), self.peak * hw.attention_efficiency(seq)
        elif cls == "fp8":  # a compiled fp8 linear (--fp8, fxshard.cost.fp8): its product at the fp8 peak
            work, rate = flops, hw.fp8_peak() * hw.efficiency.get("matmul", 0.7)
        else:  # fp8: the linears' products (torchao's float8 recipe covers nn.Linear, not grouped experts)
            peak = self.matmul_peak if cls == "matmul" else self.peak
            work, rate = flops, peak * hw.efficiency.get("matmul" if cls == "grouped" else cls, 0.7)
        return max(work / rate, nbytes / (hw.memory_bandwidth * hw.efficiency["memory"]))

    def _stage_split(self, stages: int) -> tuple[tuple[tuple[str, int], ...], ...]:
        """Each stage's pieces with counts, cut where the compiler's pipeline pass would cut: its balance of block
        FLOPs and parameter bytes (:func:`fxshard.ir.cut.balance`), at the example's size."""
        kinds = self.profile.kinds
        pieces = self.profile.pieces("tp1")
        at = {b: 1, S: self.profile.example[S], T: 1}
        flops = {n: float(sum(p.flops.values(), sympy.Integer(0)).subs(at)) for n, p in pieces.items()}
        params = {n: float(p.params + p.frozen + p.experts) for n, p in pieces.items()}
        total_f = sum(flops[k] for k in kinds) + flops.get("before", 0) + flops.get("after", 0) or 1
        total_p = sum(params[k] for k in kinds) + params.get("before", 0) + params.get("after", 0) or 1
        cost = {n: flops[n] / total_f + params[n] / total_p for n in flops}
        sizes = balance([cost[k] for k in kinds], stages, cost.get("before", 0), cost.get("after", 0))
        out, i = [], 0
        for s, n in enumerate(sizes):
            counts: dict[str, int] = {}
            for k in kinds[i:i + n]:
                counts[k] = counts.get(k, 0) + 1
            i += n
            parts = ([("before", 1)] if s == 0 and "before" in pieces else []) + sorted(counts.items())
            out.append(tuple(parts + ([("after", 1)] if s == stages - 1 and "after" in pieces else [])))
        return tuple(out)


def fp8_cast_seconds(ops, hw: Hardware) -> float:
    """The float8 casts of one pass of a piece's matmuls under dynamic tensorwise scaling, as eager torchao runs
    them: each bf16 operand is read for its amax, read again and written as float8, ``FP8_CAST_BYTES`` (2.5) bytes
    per bf16 byte, counted on the op's operands and result (``nbytes``): forward casts the input and the weight,
    backward the output's gradient and the saved bf16 input and weight again (torchao saves them unscaled).

    >>> from fxshard.cost.hardware import Hardware, Link
    >>> fp8_cast_seconds([("matmul", 1e9, 4e6, False)], Hardware("x", {}, 1e12, 1, 1, Link(1, 0), Link(1, 0),
    ...                                                  efficiency={"memory": 0.5}))
    2e-05
    """
    nbytes = sum(by for cls, _, by, _ in ops if cls == "matmul")
    return FP8_CAST_BYTES * nbytes / (hw.memory_bandwidth * hw.efficiency["memory"])


def causal_share(seq: int) -> float:
    """The share of an S x S score matrix a causal attention kernel computes: each query against the keys at and
    before it, ``(S + 1) / 2S`` (flash kernels skip the tiles above the diagonal; the counted FLOPs have them all).

    >>> causal_share(4), causal_share(8192)
    (0.625, 0.50006103515625)
    """
    return (seq + 1) / (2 * seq)


def selective_redo(t_mem: float, kernels: float, hw: Hardware) -> float:
    """What selective recompute adds to a block's backward: its memory-bound ops run again (``t_mem``), and every
    op of the block pays the policy's dispatch (``hw.selective_overhead`` per op, calibrate's measure of torch's
    selective checkpoint over plain autograd, forward and recompute together)."""
    return t_mem + kernels * hw.selective_overhead


def _compile(piece: Piece):
    """The piece's expressions as one function of (b, S, T) per part: all of it, and its S**2 part (which grows with
    the whole sequence, not the local one, under cp: queries local, keys whole)."""
    exprs = {"traffic": piece.traffic, "kernels": sympy.Integer(piece.kernels), "params": piece.params,
             "casts": piece.casts, "casts_bwd": piece.casts_bwd,
             "redo_traffic": piece.redo_traffic, "redo_kernels": sympy.Integer(piece.redo_kernels),
             "frozen": piece.frozen,             "experts": piece.experts, "tied": piece.tied,
             "boundary": piece.boundary,
             "boundary_grad": piece.boundary_grad, "kv": piece.kv, "dispatched": piece.dispatched}
    exprs |= {f"largest:{i}": e for i, e in enumerate(piece.largest or [sympy.Integer(0)])}
    exprs |= {f"saved:{m}": e for m, e in piece.saved.items()}
    ops = piece.ops
    exprs |= {f"op{i}:f": op[1] for i, op in enumerate(ops)} | {f"op{i}:b": op[2] for i, op in enumerate(ops)}
    exprs |= {f"comm{i}": c.nbytes for i, c in enumerate(piece.comms)} | \
        {f"overlap{i}": c.overlap for i, c in enumerate(piece.comms)}
    keys = list(exprs)
    full = [sympy.expand(exprs[k]) for k in keys]
    square = [e.coeff(S, 2) * S**2 if e.is_polynomial(S) else sympy.Integer(0) for e in full]
    f_all = sympy.lambdify((b, S, T), full, "math")
    f_sq = sympy.lambdify((b, S, T), square, "math")
    return keys, f_all, f_sq, [(op[0], op[3]) for op in ops], [(c.op, c.axis, c.direction, c.amaxes)
                                                                for c in piece.comms]


def _values(fns, rows: int, seq: int, tp: int, cp: int) -> dict:
    keys, f_all, f_sq, op_classes, comms = fns
    local = max(seq // cp, 1)
    raw = f_all(rows, local, tp)
    if cp > 1:
        raw = [v + (cp - 1) * w for v, w in zip(raw, f_sq(rows, local, tp), strict=True)]
    v = dict(zip(keys, (float(x) for x in raw), strict=True))
    out = {k: v[k] for k in keys if ":" not in k and not k.startswith(("comm", "overlap"))}
    out["saved"] = {k.split(":")[1]: v[k] for k in keys if k.startswith("saved:")}
    out["largest"] = max(v[k] for k in keys if k.startswith("largest:"))
    out["ops"] = [(c, v[f"op{i}:f"], v[f"op{i}:b"], causal) for i, (c, causal) in enumerate(op_classes)]
    out["comms"] = [(*c[:3], v[f"comm{i}"], v[f"overlap{i}"], c[3]) for i, c in enumerate(comms)]
    return out


def spread(layout: Layout, axis: str, gpus_per_node: int) -> int:
    """How many nodes one group along ``axis`` spans (mesh order dp, cp, pp, tp; ep: consecutive dp ranks; cp_tp:
    the cp and tp ranks of one dp and pp coordinate)."""
    cp = getattr(layout, "cp", 1)
    if axis == "cp_tp":
        return len({(c * layout.tp * layout.pp + t) // gpus_per_node for c in range(cp) for t in range(layout.tp)})
    stride = {"tp": 1, "pp": layout.tp, "cp": layout.tp * layout.pp, "dp": layout.tp * layout.pp * cp,
              "ep": layout.tp * layout.pp * cp}[axis]
    size = {"tp": layout.tp, "pp": layout.pp, "cp": cp, "dp": layout.dp, "ep": layout.ep}[axis]
    return len({(k * stride) // gpus_per_node for k in range(size)})


def _prepared(ev: Evaluator, layout: Layout, setting: Setting, accumulate: int = 1):
    """The microbatch count and rows, the stages, and each piece's cost under ``layout``."""
    cp = getattr(layout, "cp", 1)
    m = layout.microbatches or 1 if layout.pp > 1 else accumulate
    rows = setting.global_batch // (layout.dp * m)
    structure = "tp1" if layout.tp == 1 else ("sp" if layout.sp else "tp")
    stages = ev.stage_split(layout.num_stages) if layout.pp > 1 else (_whole(ev.profile),)
    spread_tp, spread_cptp = (spread(layout, axis, setting.gpus_per_node) for axis in ("tp", "cp_tp"))
    cost = {name: ev.piece(structure, name, rows, setting.seq, layout.tp, cp, spread_tp, spread_cptp)
            for name in {n for st in stages for n, _ in st}}
    return m, rows, stages, cost


def peaks(ev: Evaluator, layout: Layout, setting: Setting, accumulate: int = 1) -> list[float]:
    """The predicted peak bytes of each pp rank (the memory verdict alone, without the time)."""
    m, rows, stages, cost = _prepared(ev, layout, setting, accumulate)
    pred = Prediction(layout, rows, m, [], memory=ev.hw.memory)
    _memory(ev, layout, stages, cost, pred)
    return pred.peaks


def peaks_by_mode(ev: Evaluator, layout: Layout, setting: Setting, accumulate: int = 1, modes=("none",)
                  ) -> dict[str, float]:
    """The worst pp rank's predicted peak under each recompute mode of ``modes`` (the search's verdicts, at once)."""
    m, _, stages, cost = _prepared(ev, layout, setting, accumulate)
    return {mode: max(p) for mode, p in _peaks(ev, layout, stages, cost, m, modes).items()}


def lower_bound(ev: Evaluator, layout: Layout, setting: Setting, accumulate: int = 1) -> float:
    """A step no schedule beats: the busiest pp rank's actions back to back, with its data-parallel work."""
    m, rows, stages, cost = _prepared(ev, layout, setting, accumulate)
    durations = [_stage_times(ev, layout, setting, st, cost) for st in stages]
    worst = 0.0
    for r in range(layout.pp):
        own = [stages[s] for s in (layout.stages_of(r) if layout.pp > 1 else [0])]
        times = [durations[s] for s in (layout.stages_of(r) if layout.pp > 1 else [0])]
        post = _dp_after(ev, layout, setting, own, cost, times)
        worst = max(worst, _dp_before(ev, layout, setting, own, cost) + m * sum(d.fwd + d.bwd for d in times)
                    + post[0] + post[1])
    return worst


def predict(ev: Evaluator, layout: Layout, setting: Setting, accumulate: int = 1) -> Prediction:
    """Step time, throughput and memory of ``layout`` at ``setting`` (sequence, global batch, devices per node);
    ``accumulate``: at pp=1, the batches a step accumulates (``fxshard run --grad-accum``), the microbatches."""
    m, rows, stages, cost = _prepared(ev, layout, setting, accumulate)
    pred = Prediction(layout, rows, m, [[f"{n} x{c}" if c > 1 else n for n, c in st] for st in stages],
                      memory=ev.hw.memory, accumulate=m if layout.pp == 1 else 1)
    durations = [_stage_times(ev, layout, setting, st, cost) for st in stages]
    _pipeline(ev, layout, setting, stages, cost, durations, pred)
    _memory(ev, layout, stages, cost, pred)
    world = layout.world_size
    pred.tokens_per_s = setting.global_batch * setting.seq / pred.step / world
    pred.mfu = 3 * model_flops(ev, setting.seq) * setting.global_batch / (pred.step * world * ev.peak)
    return pred


def _whole(profile: ModelProfile) -> tuple:
    counts: dict[str, int] = {}
    for k in profile.kinds:
        counts[k] = counts.get(k, 0) + 1
    pieces = profile.pieces("tp1")
    return tuple(([("before", 1)] if "before" in pieces else []) + sorted(counts.items()) +
                 ([("after", 1)] if "after" in pieces else []))


@functools.lru_cache(maxsize=64)
def _model_flops(ev: Evaluator, seq: int) -> float:
    st = _whole(ev.profile)
    return sum(c * ev.piece("tp1", n, 1, seq, 1, 1, 1).flops for n, c in st)


def single_step(ev: Evaluator, rows: int, seq: int) -> float:
    """Seconds of the whole model's forward and backward on one device at ``rows`` x ``seq``: no communication, no
    optimizer step (what ``fxshard calibrate --model`` measures, to set ``compute_scale``)."""
    return sum(c * (p.fwd + p.bwd) for n, c in _whole(ev.profile) for p in [ev.piece("tp1", n, rows, seq, 1, 1, 1)])


def model_flops(ev: Evaluator, seq: int) -> float:
    """Forward FLOPs of one sequence through the whole model (flop_counter's count: attention over all S x S)."""
    return _model_flops(ev, seq)


@dataclass
class _StageTime:
    fwd: float  # one microbatch's forward, compute + exposed communication
    bwd: float
    wgrad: float
    busy: float  # compute alone (forward, backward, recompute)
    exposed: dict  # axis -> seconds per microbatch
    fwd_compute: float
    bwd_compute: float  # without recompute
    redo: float  # recompute


def _stage_times(ev: Evaluator, layout: Layout, setting: Setting, stage, cost) -> _StageTime:
    hw, mode = ev.hw, layout.recompute if layout.recompute in ("selective", "full") else "none"
    cp, spread_cp = getattr(layout, "cp", 1), spread(layout, "cp", setting.gpus_per_node)
    spread_ep = spread(layout, "ep", setting.gpus_per_node)
    fwd = bwd = wgrad = busy = fc = bc = again = 0.0
    exposed = {"tp": 0.0, "cp": 0.0, "ep": 0.0, "dp": 0.0}
    for name, count in stage:
        c = cost[name]
        block = name.startswith("block")
        redo = c.redo[mode] if block else 0.0
        tp_redo = c.tp_redo if block and mode != "none" else 0.0
        cp_f = cp_b = 0.0
        if cp > 1 and c.kv:
            if getattr(layout, "cp_mode", "allgather") == "ring":
                cp_f = hw.exposed((cp - 1) * hw.p2p_seconds(c.kv, spread_cp), c.attention)
                cp_b = hw.exposed((cp - 1) * hw.p2p_seconds(2 * c.kv, spread_cp), 2.5 * c.attention)
            else:
                cp_f = hw.collective_seconds("all_gather", c.kv * cp, cp, spread_cp)
                cp_b = hw.collective_seconds("reduce_scatter", c.kv * cp, cp, spread_cp)
        ep_t = 2 * hw.collective_seconds("all_to_all", c.dispatched, layout.ep, spread_ep) if layout.ep > 1 else 0.0
        fwd += count * (c.fwd + c.tp_fwd + cp_f + ep_t)
        bwd += count * (c.bwd + c.tp_bwd + cp_b + ep_t + redo + tp_redo + (cp_f + ep_t if redo else 0.0))
        wgrad += count * c.wgrad
        busy += count * (c.fwd + c.bwd + redo)
        fc += count * c.fwd
        bc += count * c.bwd
        again += count * redo
        exposed["tp"] += count * (c.tp_fwd + c.tp_bwd + tp_redo)
        # recompute runs the block's forward collectives again (counted in bwd above): exposed as the others are
        exposed["cp"] += count * (cp_f + cp_b + (cp_f if redo else 0.0))
        exposed["ep"] += count * (2 * ep_t + (ep_t if redo else 0.0))
    zero3_f, zero3_b = _zero3_per_microbatch(ev, layout, setting, stage, cost)
    exposed["dp"] += zero3_f + zero3_b
    return _StageTime(fwd + zero3_f, bwd + zero3_b, wgrad, busy, exposed, fc, bc, again)


def _zero3_per_microbatch(ev, layout, setting, stage, cost) -> tuple[float, float]:
    """ZeRO 3's gathers of one forward and one backward (FSDP2 reshards after each and gathers again): each block's,
    prefetched during the block before (the exposed rest); the stage's other parameters (embedding, head) gathered
    before it runs."""
    if layout.zero != 3 or layout.dp == 1:
        return 0.0, 0.0
    low = 2 if Layout(dtype=ev.dtype).mixed else 4
    group, sp = layout.dp * getattr(layout, "cp", 1), spread(layout, "dp", setting.gpus_per_node)
    f = b = 0.0
    for name, count in stage:
        c = cost[name]
        gather = ev.hw.collective_seconds("all_gather", (c.params + c.frozen) * low, group, sp)
        block = name.startswith("block")
        f += count * (ev.hw.exposed(gather, c.fwd) if block else gather)
        b += count * (ev.hw.exposed(gather, c.bwd) if block else 0.0)  # the root stays gathered for backward
    return f, b


def _pipeline(ev: Evaluator, layout: Layout, setting: Setting, stages, cost, durations, pred: Prediction) -> None:
    """The step: torch's schedule simulated with the stages' durations, then each rank's data-parallel
    communication and optimizer step."""
    hw, pp, v, m = ev.hw, layout.pp, layout.stages_per_rank, pred.microbatches
    sp_pp = spread(layout, "pp", setting.gpus_per_node)
    nxt = [cost[st[1][0] if st[0][0] == "before" and len(st) > 1 else st[0][0]] for st in stages]
    pre = {r: _dp_before(ev, layout, setting, [stages[s] for s in layout.stages_of(r)], cost) for r in range(pp)}
    if pp == 1:
        d = durations[0]
        ends, busy = {0: pre[0] + m * (d.fwd + d.bwd)}, {0: m * (d.fwd + d.bwd)}
    else:
        def duration(a):
            d = durations[a.stage_index]
            kind = a.kind
            return {"F": d.fwd, "B": d.bwd, "I": d.bwd - d.wgrad, "W": d.wgrad}[kind]

        def transfer(a, forward):
            s = a.stage_index
            piece = nxt[s] if forward else nxt[s + 1]
            return hw.p2p_seconds(piece.boundary if forward else piece.boundary_grad, sp_pp)

        ends, busy = pipeline_step(layout.schedule, pp, m, v, duration, transfer, pre)
        if hw.contention > 1:
            ends = _shared_cores(hw, layout, m, v, duration, transfer, pre, busy)
    post = {r: _dp_after(ev, layout, setting, [stages[s] for s in layout.stages_of(r)], cost,
                         [durations[s] for s in layout.stages_of(r)]) for r in range(pp)}
    finish = {r: ends[r] + post[r][0] + post[r][1] for r in ends}
    crit = max(finish, key=finish.get)
    own = [durations[s] for s in layout.stages_of(crit)]
    pred.step = finish[crit]
    pred.compute = m * sum(d.busy for d in own)
    pred.exposed = {axis: m * sum(d.exposed[axis] for d in own) for axis in ("tp", "cp", "ep", "dp")}
    pred.exposed["dp"] += post[crit][0] + pre[crit]
    idle = max(0.0, ends[crit] - pre[crit] - busy[crit])
    pred.imbalance = min(idle, max(0.0, max(busy.values()) - busy[crit]))
    pred.bubble = idle - pred.imbalance
    pred.terms = {"compute": m * sum(d.fwd_compute + d.bwd_compute for d in own),
                  "recompute": m * sum(d.redo for d in own),
                  **{f"{k} communication": t for k, t in pred.exposed.items()},
                  "stage imbalance": pred.imbalance, "pipeline bubble": pred.bubble, "optimizer step": post[crit][1]}


def _shared_cores(hw, layout: Layout, m: int, v: int, duration, transfer, pre, busy) -> dict[int, float]:
    """Each pp rank's end when the ranks share too few cores (a CPU profile's ``contention`` > 1: the rate one rank
    computes at alone over the rate each reaches when all compute, as calibrate measures them).  The durations are
    the rates with every rank busy; a rank waiting in the bubble gives its share to the others, so the schedule runs
    no slower than at the rate alone, and no faster than the ranks' work at the shared rate, spread evenly."""
    fast, _ = pipeline_step(layout.schedule, layout.pp, m, v, lambda a: duration(a) / hw.contention, transfer, pre)
    shared = sum(busy.values()) / len(busy)
    return {r: max(fast[r], pre[r] + shared) for r in fast}


def _dense(stage, cost, layout) -> float:
    """Trained parameters of a stage (the experts apart): what gradients are reduced for and the optimizer steps."""
    return sum(n * cost[name].params for name, n in stage)


def _frozen(stage, cost) -> float:
    """Parameters of a stage that do not train: held, and gathered under FSDP2, but never reduced or stepped."""
    return sum(n * cost[name].frozen for name, n in stage)


def _dp_before(ev, layout, setting, stages, cost) -> float:
    """What a rank waits for before its first forward: ZeRO 2's gather of its stage modules."""
    if layout.dp * getattr(layout, "cp", 1) == 1 or layout.zero != 2:
        return 0.0
    low = 2 if Layout(dtype=ev.dtype).mixed else 4
    psi = sum(_dense(st, cost, layout) + _frozen(st, cost) for st in stages)
    return ev.hw.collective_seconds("all_gather", psi * low, layout.dp * getattr(layout, "cp", 1),
                                    spread(layout, "dp", setting.gpus_per_node))


def _dp_after(ev, layout, setting, stages, cost, durations) -> tuple[float, float]:
    """(exposed gradient communication after the last backward, optimizer step) of one pp rank."""
    hw = ev.hw
    mixed = Layout(dtype=ev.dtype).mixed
    low = 2 if mixed else 4
    group = layout.dp * getattr(layout, "cp", 1)
    sp = spread(layout, "dp", setting.gpus_per_node)
    psi = sum(_dense(st, cost, layout) for st in stages)
    experts = sum(n * cost[name].experts for st in stages for name, n in st) / layout.ep
    last_bwd = sum(d.bwd for d in durations)
    first_fwd = durations[0].fwd
    t = 0.0
    if group > 1:
        if layout.zero == 0:
            last = min(DDP_BUCKET, psi * low)  # the buckets before the last are reduced during backward
            t = hw.exposed(hw.collective_seconds("all_reduce", psi * low - last, group, sp), last_bwd) + \
                hw.collective_seconds("all_reduce", last, group, sp)
        elif layout.zero == 1:
            t = hw.collective_seconds("reduce_scatter", psi * low, group, sp) + hw.exposed(
                hw.collective_seconds("all_gather", psi * low, group, sp), first_fwd)
        elif layout.zero == 2:
            t = hw.collective_seconds("reduce_scatter", psi * 4, group, sp)
        else:  # block by block during the last backward
            t = hw.exposed(hw.collective_seconds("reduce_scatter", psi * 4, group, sp), last_bwd)
    edp = layout.size(EDP)  # the ranks holding the same experts: dp/ep x cp
    if experts and edp > 1:
        t += hw.collective_seconds("all_reduce", experts * low, edp, sp)
    tied = sum(n * cost[name].tied for st in stages for name, n in st) if layout.pp > 1 else 0.0
    if tied:
        t += hw.collective_seconds("all_reduce", tied * low, 2, spread(layout, "pp", setting.gpus_per_node))
    shard = psi / group if layout.zero >= 1 else psi
    opt = (shard + experts) * OPTIMIZER_BYTES / (hw.memory_bandwidth * hw.efficiency["memory"])
    return t, opt


def _memory(ev: Evaluator, layout: Layout, stages, cost, pred: Prediction) -> None:
    """Predicted peak per pp rank, as ``fxshard plan`` predicts it (model state + saved x alive + transient)."""
    mode = layout.recompute if layout.recompute in ("selective", "full") else "none"
    pred.memory_terms = _peaks(ev, layout, stages, cost, pred.microbatches, (mode,), parts=True)[mode]
    pred.peaks = [sum(parts.values()) for parts in pred.memory_terms]


def _peaks(ev: Evaluator, layout: Layout, stages, cost, m: int, modes, parts: bool = False) -> dict[str, list]:
    """The peak of each pp rank under each recompute mode of ``modes`` (the model state and the microbatches alive
    are the same for all: worked out once); with ``parts``, each rank's peak as its :data:`MEMORY_TERMS`."""
    mixed = Layout(dtype=ev.dtype).mixed
    group = layout.dp * getattr(layout, "cp", 1)
    counts = alive_counts(layout.schedule, layout.pp,
                          capped_microbatches(layout.schedule, layout.pp, m, layout.stages_per_rank),
                          layout.stages_per_rank) if layout.pp > 1 else {0: [{0: 1}]}
    out: dict[str, list] = {mode: [] for mode in modes}
    for r in range(layout.pp):
        own = {s: stages[s] for s in (layout.stages_of(r) if layout.pp > 1 else [0])}
        psi = sum(_dense(st, cost, layout) for st in own.values())
        frozen = sum(_frozen(st, cost) for st in own.values())
        if layout.pp > 1 and r == layout.stage_rank(layout.num_stages - 1):
            psi += sum(n * cost[name].tied for name, n in own[layout.num_stages - 1])
        experts = sum(n * cost[name].experts for st in own.values() for name, n in st) / layout.ep
        blocks = [cost[name].params + cost[name].frozen for st in own.values() for name, n in st
                  if name.startswith("block") for _ in range(n)]
        state = formula(layout.zero, group, mixed, psi)  # gradients and optimizer state of the trained alone
        # the experts' own ZeRO 1 group: the ranks holding the same experts, dp/ep of them times cp (Layout.size)
        held = {"parameters": peak_params(layout.zero, group, mixed, psi + frozen, blocks),
                "gradients": state["grads"], "optimizer": state["optimizer"],
                "experts": formula(1 if layout.zero == 1 else 0, layout.size(EDP), mixed, experts)["total"],
                "transient": 2 * max(cost[name].largest for st in own.values() for name, _ in st)}
        combos = [[(c, own[s]) for s, c in combo.items() if s in own] for combo in counts[r]]
        for mode in modes:
            saved = {id(st): sum(n * cost[name].saved[mode] for name, n in st) for st in own.values()}
            activations = max(sum(c * saved[id(st)] for c, st in combo) for combo in combos)
            extra = max((cost[name].saved["none"] - cost[name].saved[mode] for st in own.values() for name, _ in st
                         if name.startswith("block")), default=0.0)
            rank = held | {"activations": activations, "recompute": extra}
            out[mode].append(rank if parts else sum(rank.values()))
    return out
