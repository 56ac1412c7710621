"""Tensor-parallel training step time at tp=2: fxshard's generated code, hand-written Megatron, DTensor.

One step is forward, backward and an AdamW step on a fixed batch of ``benchmarks/models/gpt.py``.
The three contenders live in the same two gloo processes (one intra-op thread each) and take turns
step by step (:func:`benchmarks.common.interleave`):

- ``fxshard``: the model file compiled with ``fxshard.driver.compile(path, Layout(tp=2))``; each rank
  imports its generated file, builds ``RankModule(groups, device)`` and loads its weight shard, as
  ``fxshard run`` does;
- ``hand-written``: :class:`benchmarks.megatron_gpt.MegatronGPT`, the same split written by hand;
- ``DTensor``: the unmodified model under ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` (torchtitan's recipe: q/k/v and fc_in column-wise, o_proj and fc_out row-wise,
  the embedding row-wise over the vocabulary, the tied LM head column-wise with its logits left split
  over the vocabulary for ``loss_parallel``'s cross entropy).

Each contender computes the loss the way its own stack does at its best: fxshard's vocab-parallel cross
entropy, Megatron-LM's ``_VocabParallelCrossEntropy`` in the hand-written code, DTensor's
``loss_parallel``; none of them gathers the logits.

All start from the same weights and batch (the model file's, seed 0), so their losses must agree;
:func:`run` reports each one's first loss and the largest difference from fxshard over every step.
DTensor has no sharding rule for CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``)
and its math attention mixes in a plain causal mask, so every contender runs attention with the
math backend (same kernels for all) and DTensor runs under ``implicit_replication()``.
Each contender also runs under ``torch.compile`` (inductor), each the way its stack's users compile it:

- ``fxshard --compile``: the generated module compiled as ``fxshard run --compile`` does at tp=2
  (:func:`fxshard.runtime.compiled.compile_module`: one graph, collectives as functional collectives, the
  fp32 matrix products of 4M multiply-adds and more on oneDNN: :mod:`fxshard.runtime.matmul`);
- ``fxshard --compile --cpu-matmul torch``: the same with every product on torch's own kernel (MKL), as eager
  code and plain ``torch.compile`` run them: it tells the compilation's share from the kernel's;
- ``hand-written + compile`` and ``DTensor + compile``: ``torch.compile(model)`` on the whole model (dynamo
  rewrites ``dist.all_reduce`` into functional collectives, and traces DTensor).

Every contender takes one untimed step before the rounds (it compiles the compiled ones: compilation is never
timed; its seconds are reported), so all of them take the same steps on the same batch.  The unsharded model
takes those steps too, on one device with the same AdamW: each contender's losses are reported against it.
After the timed rounds each eager contender runs one more step under
:class:`benchmarks.comm.CollectiveCounter` (a dispatch mode does not see the collectives inside a compiled
graph, which are the eager program's).

On a GPU (``run(..., device="cuda")``, ``python -m benchmarks.run --device cuda``) the two ranks are NCCL
processes, one per GPU, or both on one GPU when only one is visible (:mod:`fxshard.testing` says how NCCL is
made to accept that); ``--cpu-matmul`` is a CPU matter, so that contender is left out there.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.comm import CollectiveCounter, fxshard_stated, megatron_expected
from benchmarks.common import (
    BACKEND_OF,
    combine_ranks,
    device_sync,
    interleave,
    markdown_table,
    mps_running,
    paired_ratio,
    ratio,
    spawn,
    summarize,
)

MODEL_FILE = Path(__file__).resolve().parent / "models" / "gpt.py"
SIZE_VARIABLE = "FXSHARD_BENCH_SIZE"
TP = 2
EAGER = ("fxshard", "hand-written", "DTensor")
# the compiled contenders, each with the eager one it is compiled from
COMPILED_FROM = {"fxshard --compile": "fxshard", "fxshard --compile --cpu-matmul torch": "fxshard",
                 "hand-written + compile": "hand-written", "DTensor + compile": "DTensor"}
COMPILED = tuple(COMPILED_FROM)
CPU_MATMUL_OF = {"fxshard --compile": "onednn", "fxshard --compile --cpu-matmul torch": "torch"}  # --cpu-matmul
CONTENDERS = EAGER + COMPILED
CPU_ONLY = ("fxshard --compile --cpu-matmul torch",)  # what differs from its neighbour only on a CPU
BASES = ("fxshard", "fxshard --compile")  # the table divides these two by every other contender
EARLY = 5  # steps: the losses' agreement over a training's first steps, before they fall to the noise floor of a
# memorized batch, where relative differences of kernels that sum in other orders grow (every step trains one batch)
LOSS_TOLERANCE = 1e-5  # first-step losses of the three must agree this closely (same weights, same batch)
SINGLE_TOLERANCE = 1e-4  # relative, first EARLY steps: above it a contender trains something else than the model


@contextlib.contextmanager
def model_size(size: str):
    """Let ``benchmarks/models/gpt.py`` build the model at ``size`` (it reads :data:`SIZE_VARIABLE`)."""
    before = os.environ.get(SIZE_VARIABLE)
    os.environ[SIZE_VARIABLE] = size
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SIZE_VARIABLE, None)
        else:
            os.environ[SIZE_VARIABLE] = before


@dataclass
class Contender:
    """A model ready to train: ``loss()`` runs its forward on the fixed batch; forward and backward each run
    under ``context()``."""

    loss: Callable[[], torch.Tensor]
    optimizer: torch.optim.Optimizer
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    losses: list[float] = field(default_factory=list)

    def step(self, phase: Callable[[str], None] = lambda name: None) -> None:
        """One training step; ``phase(name)`` hears when forward, backward and the optimizer step begin."""
        phase("forward")
        with sdpa_kernel(SDPBackend.MATH), self.context():
            loss = self.loss()
        phase("backward")
        with self.context():
            loss.backward()
        phase("optimizer")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))

    def counted_step(self) -> dict:
        """One step under :class:`CollectiveCounter`; the collectives of each phase."""
        counter = CollectiveCounter()
        with counter:
            self.step(phase=lambda name: setattr(counter, "phase", name))
        return counter.counts


def _optimizer(params) -> torch.optim.Optimizer:
    """The AdamW `fxshard run` uses (foreach), its parameters grouped by type: a foreach op refuses a mix of
    DTensors and plain tensors (DTensor's LayerNorms stay plain), and two groups step to the same bits."""
    from torch.distributed.tensor import DTensor

    from fxshard.train.optim import OptimConfig

    params = list(params)
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return OptimConfig().make([{"params": g} for g in groups if g])


def contenders(device: str = "cpu") -> tuple[str, ...]:
    """The contenders timed on ``device`` ("cpu" or "cuda")."""
    return CONTENDERS if device == "cpu" else tuple(c for c in CONTENDERS if c not in CPU_ONLY)


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL (:func:`fxshard.testing.spawn` set it) or under the fake process
    group on a GPU machine (:mod:`benchmarks.profile_tp`'s rank alone), else the CPU."""
    backend = dist.get_backend()
    on_gpu = backend == "nccl" or (backend == "fake" and torch.cuda.is_available())
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def model_and_batch(size: str) -> tuple[torch.nn.Module, dict, torch.device]:
    """The unsharded model at ``size`` and its batch, the weights and batch fxshard compiled (seed 0), on this
    rank's device, and the device."""
    from fxshard.capture.modelfile import load_model_file

    device = _device()
    with model_size(size):
        full, inputs = load_model_file(MODEL_FILE).build(seed=0)
    return full.to(device), {k: v.to(device) for k, v in inputs.items()}, device


def fxshard_contender(out: Path, inputs: dict, compile: bool = False, cpu_matmul: str = "onednn",
                      groups: dict | None = None) -> Contender:
    """This rank's generated ``RankModule``, built and loaded the way ``fxshard.train.modules.build_rank`` does;
    ``compile`` and ``cpu_matmul`` as ``fxshard run --compile --cpu-matmul``; ``groups``: process groups by mesh
    axis instead of the device mesh's."""
    from torch.distributed.device_mesh import init_device_mesh

    from fxshard.capture.inputs import flatten_batch
    from fxshard.codegen.manifest import import_rank_file, read_manifest
    from fxshard.runtime import load_state

    device = _device()
    manifest = read_manifest(out)
    layout = manifest.layout
    if groups is None:
        mesh = init_device_mesh(device.type, layout.mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
        groups = {axis: mesh.get_group(axis) for axis in ("dp", "pp", "tp")}
    entry = manifest.rank(layout.coords(dist.get_rank()))
    code = import_rank_file(out / entry.file)
    module = code.RankModule(groups, device)
    module.return_outputs = False  # as fxshard.train.modules.build_rank does
    load_state(module, out / entry.weights)
    if compile:
        from fxshard.runtime.compiled import compile_module

        compile_module(module, cpu_matmul=cpu_matmul)
    leaves = [v.to(device) if isinstance(v, torch.Tensor) else v for v in flatten_batch(inputs, manifest.inputs)]
    return Contender(lambda: module(*leaves)[0], _optimizer(module.parameters()))


def hand_written_contender(full: torch.nn.Module, inputs: dict, compile: bool = False) -> Contender:
    from benchmarks.megatron_gpt import MegatronGPT

    model = MegatronGPT(full).to(next(full.parameters()).device)  # it builds some layers afresh, on the CPU
    run = torch.compile(model) if compile else model
    return Contender(lambda: run(**inputs), _optimizer(model.parameters()))


def dtensor_contender(full: torch.nn.Module, inputs: dict, compile: bool = False) -> Contender:
    """``parallelize_module`` on (a copy of) the unmodified model, torchtitan style."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    model = copy.deepcopy(full)
    mesh = init_device_mesh(_device().type, (TP,), mesh_dim_names=("tp",))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            # logits stay split over the vocabulary for loss_parallel's cross entropy (torchtitan's default)
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        # q/k/v stay DTensors: the model views them with its global head count
        plan |= {f"blocks.{i}.attn.{p}_proj": ColwiseParallel(use_local_output=False) for p in "qkv"}
        plan |= {f"blocks.{i}.attn.o_proj": RowwiseParallel(),
                 f"blocks.{i}.mlp.fc_in": ColwiseParallel(),
                 f"blocks.{i}.mlp.fc_out": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.wte.weight  # parallelizing each module separately unties them
    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(implicit_replication())
        stack.enter_context(loss_parallel())
        return stack

    run = torch.compile(model) if compile else model
    return Contender(lambda: run(**inputs), _optimizer(model.parameters()), context=context)


def single_device_losses(full: torch.nn.Module, inputs: dict, steps: int) -> list[float]:
    """The unsharded model's losses over ``steps`` steps on the fixed batch, with the contenders' AdamW and
    attention kernel, on this rank's device: what every contender's losses must match."""
    import copy

    model = copy.deepcopy(full)
    reference = Contender(lambda: model(**inputs), _optimizer(model.parameters()))
    for _ in range(steps):
        reference.step()
    return reference.losses


def _agree_on_failure(name: str, why: str | None) -> None:
    """Go on only if every rank's first step of ``name`` failed or none did: a contender left on one rank would
    wait in its collectives for a peer that dropped it."""
    whys = [None] * dist.get_world_size()
    dist.all_gather_object(whys, why)
    if len({w is None for w in whys}) > 1:
        raise RuntimeError(f"{name}: its first step failed on ranks {[r for r, w in enumerate(whys) if w]} only "
                           f"({next(w for w in whys if w)}); the ranks no longer run the same collectives")


def _worker(rank: int, world: int, out: str, size: str, rounds: int, warmup: int) -> dict:
    full, inputs, device = model_and_batch(size)
    makers = dict(zip(EAGER, (fxshard_contender, hand_written_contender, dtensor_contender), strict=True))
    sync = device_sync(device)
    ready, first_step_s, failed = {}, {}, {}
    for name in contenders(device.type):  # each built, then one untimed step: it compiles the compiled ones
        make = makers[COMPILED_FROM.get(name, name)]
        compile, why = name in COMPILED, None
        dist.barrier()
        try:
            c = make(Path(out), inputs, compile, CPU_MATMUL_OF.get(name, "onednn")) if make is fxshard_contender \
                else make(full, inputs, compile)
            start = time.perf_counter()
            c.step()
            sync()
            first_step_s[name] = time.perf_counter() - start
        except Exception as e:  # a contender this torch or device cannot run: reported, not timed
            if name == "fxshard":
                raise
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        _agree_on_failure(name, why)
        if why is None:
            ready[name] = c
        else:
            failed[name] = why
    times = interleave({name: c.step for name, c in ready.items()}, rounds=rounds, warmup=warmup, sync=sync)
    losses = {n: list(c.losses) for n, c in ready.items()}  # the same steps for all (not the counted one)
    counts = {}
    for name in (n for n in EAGER if n in ready):
        dist.barrier()
        counts[name] = ready[name].counted_step()
    single = single_device_losses(full, inputs, len(losses["fxshard"]))
    return {"times": times, "losses": losses, "collectives": counts, "first_step_s": first_step_s,
            "single_device_losses": single, "failed": failed}


def run(size: str, workdir: Path, rounds: int, warmup: int, log=print, device: str = "cpu") -> dict:
    """Compile, time and count one model size at tp=2 on ``device`` ("cpu": gloo; "cuda": NCCL); the result as
    JSON-ready data."""
    from benchmarks.models.gpt import SIZES
    from fxshard.capture.modelfile import load_model_file
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    out = workdir / f"gpt-{size}-tp{TP}"
    with model_size(size):
        start = time.perf_counter()
        compiled = compile_model(MODEL_FILE, Layout(tp=TP), out=out)
        compile_s = time.perf_counter() - start
        params = sum(p.numel() for p in load_model_file(MODEL_FILE).build_model(0).parameters())
    log(f"tp_step {size}: compiled in {compile_s:.1f} s; {rounds} interleaved rounds of "
        f"{', '.join(contenders(device))} on {device}")
    per_rank = spawn(_worker, TP, str(out), size, rounds, warmup, backend=BACKEND_OF[device])
    combined = combine_ranks([r["times"] for r in per_rank])
    step_ms = summarize(combined)
    timed, failed = list(step_ms), per_rank[0]["failed"]
    for name, why in failed.items():
        log(f"  {name:22s} FAILED on its first step, not timed: {why}")
    losses = per_rank[0]["losses"]
    single = per_rank[0]["single_device_losses"]
    agreement = {name: {"first_loss": ls[0],
                        "max_abs_diff_vs_fxshard": max(abs(a - b) for a, b in zip(ls, losses["fxshard"], strict=True)),
                        "max_rel_diff_vs_single_device": _rel(ls, single),
                        f"max_rel_diff_vs_single_device_first{EARLY}": _rel(ls[:EARLY], single)}
                 for name, ls in losses.items()}
    for name, eager in ((n, e) for n, e in COMPILED_FROM.items() if n in timed):
        agreement[name]["max_rel_diff_vs_eager"] = _rel(losses[name], losses[eager])
        agreement[name][f"max_rel_diff_vs_eager_first{EARLY}"] = _rel(losses[name][:EARLY], losses[eager])
    wrong = [n for n, a in agreement.items() if a[f"max_rel_diff_vs_single_device_first{EARLY}"] > SINGLE_TOLERANCE]
    for name in wrong:
        log(f"  WARNING: {name} trains wrong: its losses leave one-device training's by "
            f"{agreement[name][f'max_rel_diff_vs_single_device_first{EARLY}']:.1e} (relative) within {EARLY} steps; "
            "its times are those of another computation")
    firsts = [a["first_loss"] for a in agreement.values()]
    spread = max(firsts) - min(firsts)
    for name, a in agreement.items():
        t = step_ms[name]
        log(f"  {name:22s} first-step loss {a['first_loss']:.7f}  median step {t['median_ms']:.1f} ms "
            f"(CPU {t['cpu_median_ms']:.1f} ms)")
    if spread > LOSS_TOLERANCE:
        log(f"  WARNING: the first-step losses differ by {spread:.2e} (> {LOSS_TOLERANCE}): the contenders "
            "do not compute the same thing")
    ratios = {}
    for base in (b for b in BASES if b in timed):
        for other in timed:
            if other != base:
                ratios[f"{base}/{other}"] = ratio(step_ms[base]["median_ms"], step_ms[other]["median_ms"])
                ratios[f"cpu {base}/{other}"] = ratio(step_ms[base]["cpu_median_ms"], step_ms[other]["cpu_median_ms"])
                ratios[f"paired {base}/{other}"] = paired_ratio(combined, base, other)
    config = SIZES[size]
    return {
        "model": {"size": size, "file": "benchmarks/models/gpt.py", "parameters": params, **config},
        "tp": TP, "device": device, "gpus": torch.cuda.device_count() if device == "cuda" else 0,
        "mps": device == "cuda" and mps_running(), "rounds": rounds, "warmup_rounds": warmup,
        "compile_s": round(compile_s, 2),
        # rank 0's untimed first step: torch.compile's compilation for the compiled contenders
        "first_step_s": {n: round(t, 2) for n, t in per_rank[0]["first_step_s"].items()},
        "step_ms": step_ms,
        "ratios": ratios,
        "losses": agreement, "first_loss_spread": spread, "losses_agree": spread <= LOSS_TOLERANCE,
        "single_device_losses": single, "failed": failed, "trains_wrong": wrong,
        "collectives": {
            "measured": per_rank[0]["collectives"],
            "same_on_every_rank": all(r["collectives"] == per_rank[0]["collectives"] for r in per_rank),
            "megatron": megatron_expected(config["batch"], config["seq"], config["hidden"], config["vocab"],
                                          config["layers"], TP),
            "fxshard_stated": fxshard_stated(out, compiled.manifest),
        },
    }


def _rel(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference of ``losses`` from the first ``len(losses)`` of ``reference``."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference[:len(losses)], strict=True))


def _diffs(loss: dict, key: str) -> str:
    """``first EARLY / all steps`` of one relative loss difference ("—" where not measured: a measure of the
    unsharded model from 2026-11-26, of the first steps from then too)."""
    whole, early = loss.get(key), loss.get(f"{key}_first{EARLY}")
    if whole is None:
        return "—"
    return f"{whole:.1e}" if early is None else f"{early:.1e} / {whole:.1e}"


def _gpu_preamble(first: dict) -> str:
    if first["gpus"] >= TP:
        placed = "one rank per GPU"
    else:
        turns = ("under MPS (the CUDA Multi-Process Service) their kernels run side by side" if first.get("mps") else
                 "without MPS the GPU time-slices the two processes, and a rank's NCCL kernel that waits for its peer "
                 "holds the GPU until its slice ends")
        placed = (f"{first['gpus']} GPU for {TP} ranks: they share it (NCCL_HOSTID per rank: NCCL's socket transport "
                  "over loopback, `fxshard/testing.py`), so the collectives cross host memory, not NVLink, and "
                  + turns)
    return ("Step = forward + backward + AdamW (foreach) at tp=2 on NCCL: 2 processes, each rank's CUDA kernels "
            f"queued by one host thread, {first['rounds']} interleaved rounds after {first['warmup_rounds']} warm-up "
            "rounds and one untimed step that compiles the compiled contenders (torch.compile, inductor: Triton "
            "kernels; each the whole model); the clock is read after `torch.cuda.synchronize()`.  Attention on the "
            f"math SDPA backend for all, as on the CPU.  {placed}.  The CPU columns count NCCL's proxy threads, "
            "which poll while a collective is in flight.  A contender whose losses leave one-device training's by "
            f"more than {SINGLE_TOLERANCE:g} (relative) within {EARLY} steps is marked as training wrong.  Targets "
            "(issue 19): fxshard --compile ÷ hand-written ≤ 0.85 and ÷ hand-written + compile ≤ 1.0; fxshard ÷ "
            "DTensor ≤ 0.5 (issue 7).\n\n")


def _paired(p: dict) -> str:
    return f"**{p['median']:.3f}** ({p['p25']:.2f}–{p['p75']:.2f})"


def _over(q: dict, base: str, c: str, kind: str) -> str:
    if c == base or "paired " + base + "/" + c not in q:  # the base itself, or a base that failed
        return "—"
    return _paired(q["paired " + base + "/" + c]) if kind == "paired" else f"{q['cpu ' + base + '/' + c]:.3f}"


def markdown(results: list[dict]) -> str:
    """The step-time table: per model size, one row per contender."""
    from benchmarks.cpu_matmul import millions
    from fxshard.runtime.matmul import MIN_MULTIPLY_ADDS

    rows = []
    for r in results:
        m, q = r["model"], r["ratios"]
        model = f"{m['size']}: {m['layers']}×{m['hidden']}, vocab {m['vocab']}, {m['batch']}×{m['seq']} tokens"
        timed = list(r["step_ms"])
        for c in timed:
            t, loss = r["step_ms"][c], r["losses"][c]
            rows.append([
                model if c == timed[0] else "", f"{c} **(trains wrong)**" if c in r.get("trains_wrong", ()) else c,
                f"{t['median_ms']:.1f} ({t['p25_ms']:.0f}–{t['p75_ms']:.0f})", f"{t['cpu_median_ms']:.1f}",
                f"{r['first_step_s'][c]:.1f}" if c in COMPILED else "—",
                *(_over(q, base, c, kind) for base in BASES for kind in ("paired", "cpu")),
                f"{loss['first_loss']:.7f}", f"{loss['max_abs_diff_vs_fxshard']:.1e}",
                _diffs(loss, "max_rel_diff_vs_eager"), _diffs(loss, "max_rel_diff_vs_single_device"),
            ])
        rows += [["", c, f"failed on its first step, not timed: {why}"] for c, why in r.get("failed", {}).items()]
    header = ["model", "contender", "step ms, median (p25–p75)", "CPU ms per step, both ranks",
              "first step s (compiles)", "fxshard ÷ this, per round: median (p25–p75)", "fxshard ÷ this, CPU",
              "fxshard --compile ÷ this, per round: median (p25–p75)", "fxshard --compile ÷ this, CPU",
              "first-step loss", "largest loss difference from fxshard, all steps",
              f"compiled vs its eager run: largest relative loss difference, first {EARLY} steps / all",
              f"vs the unsharded model on one device: largest relative loss difference, first {EARLY} steps / all"]
    rows = [row + ["—"] * (len(header) - len(row)) for row in rows]
    first = results[0]
    if first.get("device", "cpu") == "cuda":
        return _gpu_preamble(first) + markdown_table(header, rows)
    return ("Step = forward + backward + AdamW (foreach: bitwise the per-tensor loop) at tp=2: 2 gloo processes "
            f"with one intra-op thread each, {first['rounds']} interleaved rounds after {first['warmup_rounds']} "
            "warm-up rounds and one untimed step that compiles the compiled contenders (torch.compile, inductor: "
            f"each the whole model; `fxshard --compile` runs its fp32 products of {millions(MIN_MULTIPLY_ADDS)} "
            "multiply-adds and more on oneDNN, the others all theirs on torch's MKL: the next section times the two "
            "kernels); attention on "
            "the math SDPA "
            "backend for all (DTensor has no CPU flash-attention rule).  Targets: fxshard ÷ hand-written ≤ 1.05, "
            "fxshard ÷ DTensor ≤ 0.5; fxshard --compile ÷ hand-written ≤ 0.85 and ÷ hand-written + compile ≤ 1.0.  "
            "\"Per round\" divides the base's step time by the other's in the same interleaved round (load from "
            "elsewhere hits both).  DTensor's cost over hand-written code is a fixed dispatch cost per operator, so "
            "its share of a step falls as the matrices grow: the tiny model is dispatch-bound (as small kernels on "
            "a GPU are), the medium one compute-bound on these CPU cores.\n\n" + markdown_table(header, rows))
