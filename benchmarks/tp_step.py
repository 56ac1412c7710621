"""Tensor-parallel training step time at tp=2: fxshard's generated code, hand-written Megatron, DTensor.

One step is forward, backward and an AdamW step on a fixed batch of ``benchmarks/models/gpt.py``.
The three contenders live in the same two gloo processes (one intra-op thread each) and take turns
step by step (:func:`benchmarks.common.interleave`):

- ``fxshard``: the model file compiled with ``fxshard.compiler.compile(path, Layout(tp=2))``; each rank
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
timed; its seconds are reported), so all of them take the same steps on the same batch.
After the timed rounds each eager contender runs one more step under
:class:`benchmarks.comm.CollectiveCounter` (a dispatch mode does not see the collectives inside a compiled
graph, which are the eager program's).
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
from benchmarks.common import combine_ranks, interleave, markdown_table, paired_ratio, ratio, spawn, summarize

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
BASES = ("fxshard", "fxshard --compile")  # the table divides these two by every other contender
LOSS_TOLERANCE = 1e-5  # first-step losses of the three must agree this closely (same weights, same batch)


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


def fxshard_contender(out: Path, inputs: dict, compile: bool = False, cpu_matmul: str = "onednn") -> Contender:
    """This rank's generated ``RankModule``, built and loaded the way ``fxshard.train.launch.train`` does;
    ``compile`` and ``cpu_matmul`` as ``fxshard run --compile --cpu-matmul``."""
    from torch.distributed.device_mesh import init_device_mesh

    from fxshard.capture.inputs import flatten_batch
    from fxshard.codegen.manifest import import_rank_file, read_manifest
    from fxshard.runtime import load_state

    manifest = read_manifest(out)
    layout = manifest.layout
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
    groups = {axis: mesh.get_group(axis) for axis in ("dp", "pp", "tp")}
    entry = manifest.rank(layout.coords(dist.get_rank()))
    code = import_rank_file(out / entry.file)
    module = code.RankModule(groups, torch.device("cpu"))
    module.return_outputs = False  # as fxshard.train.launch.train does
    load_state(module, out / entry.weights)
    if compile:
        from fxshard.runtime.compiled import compile_module

        compile_module(module, cpu_matmul=cpu_matmul)
    leaves = flatten_batch(inputs, manifest.inputs)
    return Contender(lambda: module(*leaves)[0], _optimizer(module.parameters()))


def hand_written_contender(full: torch.nn.Module, inputs: dict, compile: bool = False) -> Contender:
    from benchmarks.megatron_gpt import MegatronGPT

    model = MegatronGPT(full)
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
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
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


def _worker(rank: int, world: int, out: str, size: str, rounds: int, warmup: int) -> dict:
    from fxshard.capture.modelfile import load_model_file

    with model_size(size):
        full, inputs = load_model_file(MODEL_FILE).build(seed=0)  # the weights and batch fxshard compiled
    makers = (fxshard_contender, hand_written_contender, dtensor_contender)
    contenders = {name: make(Path(out), inputs) if make is fxshard_contender else make(full, inputs)
                  for name, make in zip(EAGER, makers, strict=True)}
    for name, eager in COMPILED_FROM.items():
        make = makers[EAGER.index(eager)]
        contenders[name] = make(Path(out), inputs, compile=True, cpu_matmul=CPU_MATMUL_OF[name]) \
            if make is fxshard_contender else make(full, inputs, compile=True)
    first_step_s = {}
    for name, c in contenders.items():  # untimed: compiles the compiled contenders
        dist.barrier()
        start = time.perf_counter()
        c.step()
        first_step_s[name] = time.perf_counter() - start
    times = interleave({name: c.step for name, c in contenders.items()}, rounds=rounds, warmup=warmup)
    losses = {n: list(c.losses) for n, c in contenders.items()}  # the same steps for all (not the counted one)
    counts = {}
    for name in EAGER:
        dist.barrier()
        counts[name] = contenders[name].counted_step()
    return {"times": times, "losses": losses, "collectives": counts,
            "first_step_s": first_step_s}


def run(size: str, workdir: Path, rounds: int, warmup: int, log=print) -> dict:
    """Compile, time and count one model size at tp=2; the result as JSON-ready data."""
    from benchmarks.models.gpt import SIZES
    from fxshard.capture.modelfile import load_model_file
    from fxshard.compiler import compile as compile_model
    from fxshard.ir.context import Layout

    out = workdir / f"gpt-{size}-tp{TP}"
    with model_size(size):
        start = time.perf_counter()
        compiled = compile_model(MODEL_FILE, Layout(tp=TP), out=out)
        compile_s = time.perf_counter() - start
        params = sum(p.numel() for p in load_model_file(MODEL_FILE).build_model(0).parameters())
    log(f"tp_step {size}: compiled in {compile_s:.1f} s; {rounds} interleaved rounds of {', '.join(CONTENDERS)}")
    per_rank = spawn(_worker, TP, str(out), size, rounds, warmup)
    combined = combine_ranks([r["times"] for r in per_rank])
    step_ms = summarize(combined)
    losses = per_rank[0]["losses"]
    agreement = {name: {"first_loss": ls[0],
                        "max_abs_diff_vs_fxshard": max(abs(a - b) for a, b in zip(ls, losses["fxshard"], strict=True))}
                 for name, ls in losses.items()}
    for name, eager in COMPILED_FROM.items():
        agreement[name]["max_rel_diff_vs_eager"] = max(
            abs(a - b) / abs(b) for a, b in zip(losses[name], losses[eager], strict=True))
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
    for base in BASES:
        for other in CONTENDERS:
            if other != base:
                ratios[f"{base}/{other}"] = ratio(step_ms[base]["median_ms"], step_ms[other]["median_ms"])
                ratios[f"cpu {base}/{other}"] = ratio(step_ms[base]["cpu_median_ms"], step_ms[other]["cpu_median_ms"])
                ratios[f"paired {base}/{other}"] = paired_ratio(combined, base, other)
    config = SIZES[size]
    return {
        "model": {"size": size, "file": "benchmarks/models/gpt.py", "parameters": params, **config},
        "tp": TP, "rounds": rounds, "warmup_rounds": warmup, "compile_s": round(compile_s, 2),
        # rank 0's untimed first step: torch.compile's compilation for the compiled contenders
        "first_step_s": {n: round(t, 2) for n, t in per_rank[0]["first_step_s"].items()},
        "step_ms": step_ms,
        "ratios": ratios,
        "losses": agreement, "first_loss_spread": spread, "losses_agree": spread <= LOSS_TOLERANCE,
        "collectives": {
            "measured": per_rank[0]["collectives"],
            "same_on_every_rank": all(r["collectives"] == per_rank[0]["collectives"] for r in per_rank),
            "megatron": megatron_expected(config["batch"], config["seq"], config["hidden"], config["vocab"],
                                          config["layers"], TP),
            "fxshard_stated": fxshard_stated(out, compiled.manifest),
        },
    }


def _paired(p: dict) -> str:
    return f"**{p['median']:.3f}** ({p['p25']:.2f}–{p['p75']:.2f})"


def _over(q: dict, base: str, c: str, kind: str) -> str:
    if c == base:
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
        for c in CONTENDERS:
            t, loss = r["step_ms"][c], r["losses"][c]
            eager = loss.get("max_rel_diff_vs_eager")
            rows.append([
                model if c == CONTENDERS[0] else "", c,
                f"{t['median_ms']:.1f} ({t['p25_ms']:.0f}–{t['p75_ms']:.0f})", f"{t['cpu_median_ms']:.1f}",
                f"{r['first_step_s'][c]:.1f}" if c in COMPILED else "—",
                *(_over(q, base, c, kind) for base in BASES for kind in ("paired", "cpu")),
                f"{loss['first_loss']:.7f}", f"{loss['max_abs_diff_vs_fxshard']:.1e}",
                "—" if eager is None else f"{eager:.1e}",
            ])
    header = ["model", "contender", "step ms, median (p25–p75)", "CPU ms per step, both ranks",
              "first step s (compiles)", "fxshard ÷ this, per round: median (p25–p75)", "fxshard ÷ this, CPU",
              "fxshard --compile ÷ this, per round: median (p25–p75)", "fxshard --compile ÷ this, CPU",
              "first-step loss", "largest loss difference from fxshard, all steps",
              "compiled vs its eager run: largest relative loss difference"]
    first = results[0]
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
