"""Context parallelism (``--cp N``) on gloo: step time against cp=1, bytes sent against the formula, the ring's
hidden transfer.

A small Llama (``LlamaForCausalLM`` from a config like samples/llama.py's, :data:`SHAPE`: one sequence of
:data:`SHAPE` ``seq`` tokens, so attention weighs in) is compiled at cp=1 and at cp=N in each mode (``allgather``,
``ring``, ``a2a``), for N in :data:`CPS`.  One set of N gloo processes holds the four programs of one N, and
:func:`benchmarks.common.interleave` runs one training step of each in turn (forward, backward, AdamW), the order
rotating every round; every contender trains the same global batch (the same global tokens).

- **cp=1** is the world-size-1 rank file's module with the AdamW ``fxshard run`` uses, and every one of the N
  processes trains its own copy of the whole batch at once.  So both sides share the machine's cores alike: with N
  processes on fewer cores a cp=N step and a cp=1 step are slowed by the same oversubscription, and the ideal
  ratio stays 1/N.  The cp=N programs train through ``Program.step`` (what ``fxshard run`` runs on each rank:
  gradients averaged over dp×cp, clipping, AdamW).
- **Bytes sent** are measured at the dispatcher (:class:`CpBytes`, a :class:`benchmarks.comm.CollectiveCounter`)
  during one more step of each cp program: every c10d call on the cp group with the tensors it really got, turned
  into the bytes this rank puts on the wire by the ring algorithm of its kind (all-gather of a local part ``x``:
  (N−1)·|x|; reduce-scatter of ``x``: (N−1)/N·|x|; all-to-all: (N−1)/N·|x|; send: |x|).  Next to it the
  formula per layer and direction: allgather and ring 2·(N−1)/N·B·S·h_kv (ring in N−1 sends of 2·B·S/N·h_kv), a2a
  4 all-to-alls, (N−1)/N² · B·S · (2·h_q + 2·h_kv); h_kv, h_q the key/value and query widths in bytes.
  All-reduces on the group (the gradients over dp×cp, the loss's token count: at dp=1 the dp×cp group is the cp
  group) are counted apart.
- **The ring's hidden transfer**: during :data:`RING_STEPS` more ring steps, every K/V (forward) and dK/dV
  (backward) shift records how long its wait for the transfer lasted after the block's compute (the exposed part);
  then one step's shifts, with the same shapes, between the same ranks, run alone (start, wait at once: the
  transfer's own time, median of :data:`ALONE_ROUNDS`), counted :data:`RING_STEPS` times.  Hidden share =
  1 − Σ exposed ÷ Σ alone (0 when nothing is hidden, 1 when all).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.comm import CollectiveCounter
from benchmarks.common import combine_ranks, interleave, markdown_table, paired_ratio, spawn, summarize

MODES = ("allgather", "ring", "a2a")
CPS = (2, 4)
SHAPE = {"vocab": 256, "hidden": 128, "ffn": 256, "layers": 2, "heads": 8, "kv_heads": 4, "batch": 1, "seq": 1024}
QUICK_SHAPE = SHAPE | {"seq": 64}
ALONE_ROUNDS = 5
RING_STEPS = 4  # ring steps whose shifts are timed (one step's figure swings with the load on a shared machine)
FLOAT = 4  # fp32

MODEL = '''"""A small LlamaForCausalLM for the cp benchmark (benchmarks/context_parallel.py)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, BATCH, SEQ = {vocab}, {hidden}, {ffn}, {layers}, {heads}, {kv_heads}, \\
    {batch}, {seq}


def make_model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                                        attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {{"input_ids": ids, "labels": ids.clone(), "use_cache": False}}
'''


def model_file(folder: Path, shape: dict) -> Path:
    path = folder / f"cp_llama_s{shape['seq']}.py"
    path.write_text(MODEL.format(**shape))
    return path


# ---------------------------------------------------------------- what a rank measures


def _wire(kind: str, nbytes: int, parts: int) -> int:
    """Bytes this rank sends for a call of ``kind`` whose tensors on this rank hold ``nbytes`` (ring algorithms)."""
    if kind == "all_gather":  # nbytes: the local part, passed on to each of the other N-1 ranks
        return (parts - 1) * nbytes
    if kind in ("reduce_scatter", "all_to_all"):  # nbytes: the whole input, of which N-1 parts leave
        return (parts - 1) * nbytes // parts
    if kind == "all_reduce":
        return 2 * (parts - 1) * nbytes // parts
    return nbytes  # send


class CpBytes(CollectiveCounter):
    """Per process group name: the calls and bytes on the wire of each collective kind, sends included."""

    def __init__(self, names: dict[str, str], sizes: dict[str, int]):
        super().__init__()
        self.names, self.sizes = names, sizes  # group name -> axis ("cp", "dp_cp"), axis -> its size
        self.wire: dict[str, dict[str, dict[str, int]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "c10d":
            name = func._overloadpacket.__name__
            group = next((a for a in args if type(a).__name__ == "ScriptObject"), None)
            axis = self.names.get(dist.ProcessGroup.unbox(group).group_name) if group is not None else None
            if axis is not None:  # at dp=1 the cp and dp x cp groups are one: told apart by what they carry
                axis = "dp_cp" if name == "allreduce_" else "cp"
            kind = {"allgather_": "all_gather", "_allgather_base_": "all_gather", "reduce_scatter_": "reduce_scatter",
                    "_reduce_scatter_base_": "reduce_scatter", "alltoall_base_": "all_to_all",
                    "alltoall_": "all_to_all", "allreduce_": "all_reduce", "send": "send"}.get(name)
            if axis is not None and kind is not None:
                local = args[0] if kind in ("all_reduce", "send") else args[1]  # this rank's input tensor(s)
                nbytes = sum(t.numel() * t.element_size() for t in _tensors(local))
                entry = self.wire.setdefault(axis, {}).setdefault(kind, {"calls": 0, "bytes": 0})
                entry["calls"] += 1
                entry["bytes"] += _wire(kind, nbytes, self.sizes[axis])
        return super().__torch_dispatch__(func, types, args, kwargs)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in _tensors(v)] if isinstance(x, (list, tuple)) else []


class RingTimer:
    """Wraps the ring's transfers (``fxshard.runtime.context_parallel._start_shift``): per shift, its tensors'
    shapes, its direction and the seconds its wait lasted after the block's compute."""

    def __init__(self):
        self.shifts: list[dict] = []

    def __enter__(self):
        import fxshard.runtime.context_parallel as cp

        self._cp, self._start = cp, cp._start_shift
        cp._start_shift = self._timed
        return self

    def __exit__(self, *exc):
        self._cp._start_shift = self._start

    def _timed(self, tensors, group, to_next):
        bufs, works = self._start(tensors, group, to_next)
        record = {"shapes": [list(t.shape) for t in tensors], "to_next": to_next, "exposed_s": 0.0, "group": group}
        self.shifts.append(record)
        return bufs, [_TimedWork(w, record) for w in works]

    def alone(self, rounds: int, steps: int) -> list[float]:
        """The first of ``steps`` steps' shifts again, alone (start, wait at once): each one's median seconds, for
        every step's shift alike; collective over the ring."""
        out = []
        for s in self.shifts[:len(self.shifts) // steps]:
            tensors = [torch.randn(shape) for shape in s["shapes"]]
            times = []
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                for w in self._start(tensors, s["group"], s["to_next"])[1]:
                    w.wait()
                times.append(time.perf_counter() - start)
            out.append(statistics.median(times))
        return out * steps


class _TimedWork:
    def __init__(self, work, record: dict):
        self.work, self.record = work, record

    def wait(self):
        start = time.perf_counter()
        self.work.wait()
        self.record["exposed_s"] += time.perf_counter() - start


def _baseline(out: str, model: str):
    """cp=1: the world-size-1 rank file's module, its weights, the AdamW ``fxshard run`` uses; one step's closure."""
    from benchmarks.tp_step import _optimizer
    from fxshard.capture.inputs import flatten_batch
    from fxshard.capture.modelfile import load_model_file
    from fxshard.codegen.manifest import import_rank_file, read_manifest
    from fxshard.runtime import load_state

    manifest = read_manifest(Path(out))
    entry = manifest.rank(manifest.layout.coords(0))
    module = import_rank_file(Path(out) / entry.file).RankModule({a: None for a in ("dp", "pp", "tp")},
                                                                 torch.device("cpu"))
    module.return_outputs = False
    load_state(module, Path(out) / entry.weights)
    torch.manual_seed(0)
    leaves = flatten_batch(load_model_file(Path(model)).make_inputs(), manifest.inputs)
    optimizer = _optimizer(module.parameters())
    params = list(module.parameters())

    def step():
        loss = module(*leaves)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, float("inf"))  # Program reads the norm every step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def _worker(rank: int, world: int, baseline: str, outs: dict[str, str], model: str, rounds: int, warmup: int) -> dict:
    from fxshard.train.launch import open_stream
    from fxshard.train.options import RunOptions
    from fxshard.train.program import Program

    total = rounds + warmup + 1 + RING_STEPS  # and the counted step, and the ring's timed ones
    runs = {mode: Program(Path(out), RunOptions(total), torch.device("cpu")) for mode, out in outs.items()}
    data = {mode: open_stream(run, "train") for mode, run in runs.items()}
    steps = {"cp=1": _baseline(baseline, model)}
    steps |= {mode: (lambda m=mode: runs[m].step(next(data[m]))) for mode in outs}
    times = interleave(steps, rounds=rounds, warmup=warmup)
    wire = {}
    for mode, run in runs.items():
        names = {run.groups[axis].group_name: axis for axis in ("cp", "dp_cp")}
        counter = CpBytes(names, {"cp": world, "dp_cp": world})
        with counter:
            steps[mode]()
        wire[mode] = counter.wire
    ring = None
    if "ring" in runs:
        timer = RingTimer()
        with timer:
            for _ in range(RING_STEPS):
                steps["ring"]()
        alone = timer.alone(ALONE_ROUNDS, RING_STEPS)
        ring = [{"to_next": s["to_next"], "shapes": s["shapes"], "exposed_s": s["exposed_s"], "alone_s": a}
                for s, a in zip(timer.shifts, alone, strict=True)]
    return {"times": times, "wire": wire, "ring": ring}


# ---------------------------------------------------------------- the parent


def formula(mode: str, cp: int, shape: dict) -> int:
    """Bytes one rank sends per layer in one direction (forward, or backward), by the issue's formula."""
    head = shape["hidden"] // shape["heads"]
    h_kv, h_q = shape["kv_heads"] * head * FLOAT, shape["heads"] * head * FLOAT
    tokens = shape["batch"] * shape["seq"]
    if mode == "a2a":
        return (cp - 1) * tokens * (2 * h_q + 2 * h_kv) // (cp * cp)
    return 2 * (cp - 1) * tokens * h_kv // cp


def run(workdir: Path, rounds: int, warmup: int, quick: bool = False, log=print, cps: tuple[int, ...] = CPS) -> dict:
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    shape = QUICK_SHAPE if quick else SHAPE
    path = model_file(workdir, shape)
    baseline = str(compile_model(path, Layout(), out=workdir / "cp-1").out)
    rows = []
    for cp in cps:
        outs = {mode: str(compile_model(path, Layout(cp=cp, cp_mode=mode), out=workdir / f"cp-{cp}-{mode}").out)
                for mode in MODES}
        log(f"cp: cp={cp}, {rounds} interleaved rounds of cp=1, {', '.join(MODES)}")
        per_rank = spawn(_worker, cp, baseline, outs, str(path), rounds, warmup, timeout=1200)
        combined = combine_ranks([r["times"] for r in per_rank])
        rows.append({"cp": cp, "step_ms": summarize(combined),
                     "ratio_to_cp1": {m: paired_ratio(combined, m, "cp=1") for m in MODES},
                     "bytes": [r["wire"] for r in per_rank],
                     "formula_per_layer_direction": {m: formula(m, cp, shape) for m in MODES},
                     "ring": _ring_summary([r["ring"] for r in per_rank])})
    return {"model": "LlamaForCausalLM (RoPE, grouped-query attention), fp32", "shape": shape, "rounds": rounds,
            "warmup_rounds": warmup, "rows": rows}


def _ring_summary(per_rank: list[list[dict]]) -> dict:
    out = {}
    for direction, to_next in (("forward", True), ("backward", False)):
        exposed = sum(s["exposed_s"] for r in per_rank for s in r if s["to_next"] is to_next)
        alone = sum(s["alone_s"] for r in per_rank for s in r if s["to_next"] is to_next)
        shifts = sum(1 for s in per_rank[0] if s["to_next"] is to_next) // RING_STEPS
        out[direction] = {"shifts_per_rank": shifts, "steps": RING_STEPS, "exposed_ms": round(exposed * 1e3, 3),
                          "alone_ms": round(alone * 1e3, 3),
                          "hidden_share": round(max(0.0, 1 - exposed / alone), 3) if alone else None}
    return out


def markdown(result: dict) -> str:
    sh = result["shape"]
    head = (f"{result['model']}: h={sh['hidden']}, {sh['heads']} heads ({sh['kv_heads']} key/value), "
            f"{sh['layers']} layers, one sequence of {sh['seq']} tokens (the same global tokens at every cp); "
            f"{result['rounds']} interleaved rounds after {result['warmup_rounds']} warm-up. cp=1 runs in every "
            "one of the N processes (each its own copy), so both sides share the cores alike: the ideal ratio is "
            "1/cp. cp=4 runs 4 processes on this machine's cores.")
    times, wires, rings = [], [], []
    layers = sh["layers"]
    for r in result["rows"]:
        cp = r["cp"]
        base = r["step_ms"]["cp=1"]
        times.append([f"cp={cp}", "cp=1", f"{base['median_ms']:.1f} ({base['p25_ms']:.0f}–{base['p75_ms']:.0f})",
                      f"{base['cpu_median_ms']:.1f}", "—", f"{1 / cp:.3f}"])
        for m in MODES:
            t, q = r["step_ms"][m], r["ratio_to_cp1"][m]
            times.append(["", m, f"{t['median_ms']:.1f} ({t['p25_ms']:.0f}–{t['p75_ms']:.0f})",
                          f"{t['cpu_median_ms']:.1f}", f"**{q['median']:.3f}** ({q['p25']:.2f}–{q['p75']:.2f})", ""])
            want = 2 * layers * r["formula_per_layer_direction"][m]  # forward and backward
            cp_bytes = [w[m].get("cp", {}) for w in r["bytes"]]
            sent = [sum(k["bytes"] for k in b.values()) for b in cp_bytes]
            grads = [sum(k["bytes"] for k in w[m].get("dp_cp", {}).values()) for w in r["bytes"]]
            calls = ", ".join(f"{v['calls']} {k}" for k, v in sorted(cp_bytes[0].items()))
            wires.append([f"cp={cp}" if m == MODES[0] else "", m, calls, f"{min(sent):,}–{max(sent):,}",
                          f"{want:,}", f"{max(sent) / want:.3f}" if want else "—", f"{max(grads):,}"])
        for direction, s in (r["ring"] or {}).items():
            rings.append([f"cp={cp}", direction, s["shifts_per_rank"], f"{s['exposed_ms']:.2f}", f"{s['alone_ms']:.2f}",
                          "—" if s["hidden_share"] is None else f"**{s['hidden_share']:.2f}**"])
    t1 = markdown_table(["cp", "contender", "step ms, median (p25–p75)", "CPU ms per step, all ranks",
                         "÷ cp=1, per round: median (p25–p75)", "ideal"], times)
    t2 = markdown_table(["cp", "mode", "calls on the cp group per step (rank 0)", "bytes sent per step, measured "
                         "(ranks min–max)", "formula (forward + backward, all layers)", "measured ÷ formula (max)",
                         "gradient all-reduce over dp×cp, bytes sent"], wires)
    t3 = markdown_table(["cp", "direction", "shifts per rank and step", "waited after compute, ms (all ranks)",
                         "the same transfers alone, ms (all ranks)", "share hidden behind compute"], rings)
    return "\n\n".join([head, t1, "Bytes one rank sends per training step over the cp group, measured at the "
                        "dispatcher (the tensors each call got, sent by the ring algorithm of its kind), against the "
                        "formula: allgather and ring 2·(cp−1)/cp·B·S·h_kv per layer and direction (ring in cp−1 "
                        "sends), a2a (cp−1)/cp²·B·S·(2·h_q + 2·h_kv).", t2,
                        f"The ring's K/V transfers over {RING_STEPS} training steps: how long each shift's wait "
                        "lasted after its block's compute, against the same transfers run alone. The wait also holds "
                        "the time a peer takes to reach its own send.", t3])
