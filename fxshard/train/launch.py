"""``fxshard run`` as one rank (of torchrun, or of the local launcher in :mod:`fxshard.train.local`).

Each rank imports its generated file, loads its weight shard, and trains with AdamW on its dp rank's rows of
each global batch (:func:`fxshard.train.data.open_batches`).  Rank 0 prints a line per step and, with ``metrics``, appends ``{"step", "loss"}``
JSON lines to a file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fxshard.capture.inputs import flatten_batch
from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import Manifest, RankEntry, import_rank_file, read_manifest
from fxshard.errors import FxshardError, LayoutError
from fxshard.ir.layout import DP, EDP, EP, PP, TP, Coords, Layout
from fxshard.ir.placement import Replicate
from fxshard.runtime import load_state, trace
from fxshard.runtime.data_parallel import local, make_optimizer
from fxshard.runtime.distributed_optimizer import finish_param_sync
from fxshard.runtime.dp_trace import trace_ddp, traced_fsdp
from fxshard.runtime.experts import sync_expert_grads
from fxshard.runtime.guard import named_phase, set_context
from fxshard.runtime.loss import step_tokens
from fxshard.runtime.mixed_precision import promote, split_masters
from fxshard.runtime.random import begin_batch
from fxshard.train.data import Batches, DataOptions, inputs_read, open_batches
from fxshard.train.memory import MemoryProbe
from fxshard.train.optim import ExpertSplitOptimizer, OptimConfig, clip_grad_norm_
from fxshard.train.options import RunOptions


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _start_up_error(e: Exception, rank: int, world: int, timeout_s: float) -> Exception:
    """A process group that did not form: name the ranks that never joined (from the store keys torch waited
    for) instead of torch's ``DistStoreError: wait timeout ... keys: /default_pg/0//cpu//0/1``."""
    from fxshard.runtime.guard import CollectiveError

    text = str(e)
    missing = sorted({int(m) for m in re.findall(r"/(\d+)(?=[\s,\]'\"]|$)", text.split("keys", 1)[-1])}
                     - {rank}) if "keys" in text else []
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if missing:
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {world}"
    elif joined:
        who = f"{int(joined[2]) - int(joined[1])} of {world} ranks"
    elif rank != 0 and "connect" in text:  # the store lives in rank 0 (or the launcher): nothing to join
        host = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        who = f"rank 0, which hosts the store at {host} (MASTER_ADDR:MASTER_PORT),"
    else:
        who = f"some of the {world} ranks"
    return CollectiveError(
        f"rank {rank}: start-up: {who} did not join the process group within --timeout {timeout_s:g} s "
        f"(not started, stopped, or died before connecting); {type(e).__name__}: {text.strip().splitlines()[0][:200]}")


def run_rank(out: Path, options: RunOptions, log=print, memory_report=None) -> list[float]:
    """Train as this process's rank (RANK/WORLD_SIZE from the environment); return the losses.

    With ``memory_report`` (a callable, given when ``options.memory_report`` asks for the report), rank 0 calls
    it with :func:`fxshard.train.memory.report_rows` of every rank's measured model-state bytes after training."""
    from fxshard.train.supervise import become_worker

    become_worker()  # a killed launcher takes its workers with it
    cuda = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    if cuda:
        from fxshard.train.device import check_own_gpu, rank_device

        device = rank_device(rank)  # the one GPU it sees, else LOCAL_RANK's (fxshard.train.device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=options.timeout))
        except Exception as e:
            raise _start_up_error(e, rank, int(os.environ["WORLD_SIZE"]), options.timeout) from e
    if cuda:
        check_own_gpu(rank, device, timeout_s=options.timeout)  # two ranks on one GPU, by UUID, before NCCL's first
    from fxshard.runtime import liveness
    from fxshard.runtime.guard import doing

    liveness.start(rank, doing)  # so that a rank whose collective fails can tell a stopped peer from a busy one
    try:
        if options.trace is not None:
            trace.start(rank, options.trace)
        memory = {} if memory_report is not None else None
        final_state = options.final_state
        state = {} if final_state is not None else None
        losses = train(out, options.steps, options.optim, options.metrics, device, log, memory=memory,
                       final_state=state, checkpoint=options.checkpoint_config(),
                       compile=options.compile, cpu_matmul=options.cpu_matmul, data=options.data)
        if final_state is not None:  # every rank's trained tensors, for fxshard verify
            from safetensors.torch import save_file

            Path(final_state).mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(Path(final_state) / f"rank{rank}.safetensors"))
        rows = None
        if memory_report is not None:
            from fxshard.train.memory import report_rows

            samples = [None] * dist.get_world_size()
            dist.all_gather_object(samples, memory)
            if rank == 0:
                from fxshard.tools.costs import planned_memory

                rows = report_rows(samples, read_manifest(out).layout, planned_memory(out))
                memory_report(rows)
        if trace.save() is not None:
            dist.barrier()  # every rank's file written: rank 0 joins them
            if rank == 0:
                trace.merge(options.trace, dist.get_world_size())
        if rank == 0:
            from fxshard.train.record import write_run_record

            write_run_record(out, options, losses, rows)
        return losses
    finally:
        trace.stop()
        liveness.stop()
        dist.destroy_process_group()


@dataclass
class _Run:
    """One rank's training, set up: what it holds, how one batch runs, and the optimizer."""

    manifest: Manifest
    layout: Layout
    entry: RankEntry
    coords: Coords
    groups: dict
    device: torch.device
    batches: Batches  # this dp rank's rows of each global batch
    params: list[torch.nn.Parameter]
    step_fn: Callable  # one batch's forward and backward; returns its loss
    held: dict[str, torch.nn.Module]  # prefix ("" or "StageN.") -> generated module
    finish: Callable | None  # after the batches of a step (pipeline: tied and dp gradient sums)
    opt: torch.optim.Optimizer
    weighted: list  # (parameter, weight) pairs of the global gradient norm
    first_step: int
    count_tokens: Callable | None = None  # the rank file's count of a microbatch's counted targets (token mean)
    compiled: bool = False  # --compile: fxshard's own collectives run inside torch.compile's graphs


def train(out: Path, steps: int, optim: OptimConfig = OptimConfig(), metrics: Path | None = None,
          device: torch.device | None = None, log=print, final_state: dict | None = None,
          memory: dict | None = None, checkpoint=None, compile: bool = False, cpu_matmul: str = "onednn",
          data: DataOptions = DataOptions()) -> list[float]:
    """Train the compiled program in ``out`` as this rank of the initialized default process group.

    With ``final_state`` (a dict), it is filled with this rank's trained tensors, keyed as in its
    weights file (``attr``, or ``StageN.attr`` under pipeline parallelism).  With ``memory`` (a dict),
    it is filled with the bytes of model state this rank held (see :mod:`fxshard.train.memory`) and ``psi``,
    its parameter count before dp sharding.  With ``checkpoint`` (a :class:`fxshard.train.checkpoint.CheckpointConfig`)
    it saves every ``save_every`` steps and, with ``resume``, continues from the latest checkpoint (of any
    layout) at its step: only steps after it run, and their losses are returned.  ``data``: where the batches come
from (:class:`fxshard.train.data.DataOptions`).  With ``compile``, each generated
    module's forward runs through torch.compile (:mod:`fxshard.runtime.compiled`), its large fp32 CPU matrix products
    on ``cpu_matmul``'s kernel (:mod:`fxshard.runtime.matmul`); rank 0 says how long the first step spent
    compiling."""
    locked = contextlib.nullcontext()
    if checkpoint is not None and dist.get_rank() == 0:
        from fxshard.train.supervise import checkpoint_lock

        locked = checkpoint_lock(Path(checkpoint.folder))  # one run writes a checkpoint folder at a time
    with locked:
        return _train(out, steps, optim, metrics, device, log, final_state, memory, checkpoint,
                      cpu_matmul if compile else None, data)


def _train(out, steps, optim, metrics, device, log, final_state, memory, checkpoint, compile, data) -> list[float]:
    """``compile``: None (eager) or the compiled CPU matrix products' kernel."""
    run = _set_up(Path(out), steps, optim, device or torch.device("cpu"), checkpoint, compile, data)
    try:
        return _loop(run, out, steps, optim, metrics, log, final_state, memory, checkpoint, compile)
    finally:
        run.batches.close()


def _loop(run, out, steps, optim, metrics, log, final_state, memory, checkpoint, compile) -> list[float]:
    probe = MemoryProbe(list(run.held.values()), run.layout.pp > 1) if memory is not None else None
    rank = dist.get_rank()
    losses = []
    progress = None
    if rank == 0:
        from fxshard.train.progress import StepProgress, tokens_per_step

        tokens = tokens_per_step(run.manifest, optim.grad_accum)
        progress = StepProgress(steps, run.first_step, tokens, log, terminal=None if log is print else False)
    # a resumed run appends to the metrics of the run it continues
    mode = "a" if run.first_step > 1 else "w"
    sink = open(metrics, mode) if metrics is not None and rank == 0 else None  # noqa: SIM115
    try:
        for step in range(run.first_step, steps + 1):
            start = time.perf_counter()
            measured = probe.measured_step(run.device) if probe is not None and step == steps else contextlib.nullcontext()
            with measured, trace.span(f"step {step}", "step", step=step), traced_fsdp():  # measured: the last step's saved bytes
                value = _train_step(run, step, optim, probe)  # per microbatch and peak (fxshard run --memory-report)
            seconds = time.perf_counter() - start
            if not math.isfinite(value):  # every rank has the same step loss: all stop here, none saves
                finish_param_sync(run.opt)  # every rank issued the step's gathers: let them land before stopping
                raise FxshardError(f"step {step}: the loss is {value}; training stops at the first non-finite loss "
                                   "(check the weights and inputs for inf/nan, or lower --lr)")
            losses.append(value)
            if rank == 0 and compile and step == run.first_step:
                from fxshard.runtime.compiled import compile_seconds
                from fxshard.runtime.matmul import onednn_products

                products = onednn_products()
                on_onednn = f"{products} fp32 matrix products on oneDNN; " if products else ""
                progress.print(f"compiled in {compile_seconds():.1f} s (torch.compile, inductor; {on_onednn}rank 0, "
                               f"during step {step}, which took {seconds:.1f} s)")
            if rank == 0:
                progress.step(step, value, seconds)
                if sink:
                    sink.write(json.dumps({"step": step, "loss": value, "seconds": round(seconds, 6),
                                           "tokens": tokens}) + "\n")
                    sink.flush()
            if checkpoint is not None and checkpoint.save_every and step % checkpoint.save_every == 0:
                from fxshard.train.checkpoint import save_checkpoint

                with named_phase(f"the checkpoint save of step {step}", dist.group.WORLD):
                    finish_param_sync(run.opt)  # the parameters of this step, not the gathers still in flight
                    saved = save_checkpoint(checkpoint.folder, step, Path(out), run.held, run.entry, run.opt,
                                            run.manifest, run.coords, run.groups[DP], optim, run.groups.get(EDP))
                if saved is not None:
                    (progress.print if progress else log)(f"saved checkpoint {saved}")
        with named_phase("the last step's ZeRO 1 parameter all-gathers (over dp, and edp for experts)",
                         dist.group.WORLD):
            finish_param_sync(run.opt)  # whoever reads the trained parameters next sees the last step's values
    finally:
        if progress is not None:
            progress.close()
        if sink:
            sink.close()
    if memory is not None:
        memory |= probe.sample | {"psi": _local_parameter_count(run.held, run.entry)}
    if final_state is not None:
        final_state |= _trained_state(run.held)
    return losses


def _set_up(out: Path, steps: int, optim: OptimConfig, device: torch.device, checkpoint,
            compile: str | None = None, data: DataOptions = DataOptions()) -> _Run:
    """Mesh, this rank's generated modules with their weights, data parallelism, optimizer, batches."""
    manifest = read_manifest(out)
    layout = manifest.layout
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(f"{out} was compiled for {layout.world_size} processes ({layout.describe()}) but "
                          f"{world} were started; launch with --nproc-per-node {layout.world_size}")
    check_accumulated_loss(out, manifest, optim.grad_accum)
    if layout.cp > 1 and checkpoint is not None:
        raise LayoutError(f"{out} was compiled with --cp {layout.cp}: checkpoints (--checkpoint, --resume) do not yet "
                          "save or load a context-parallel run (its cp ranks hold the same shards); drop --checkpoint, "
                          "or compile without --cp")
    with named_phase("start-up: the process groups of the dp x pp x tp mesh"):
        groups = layout.process_groups(device.type, {t.name: t.stages for t in manifest.tied_across_stages})
    coords = layout.coords(rank)
    entry = manifest.rank(coords)
    code = import_rank_file(out / entry.file)
    batches = open_batches(load_model_file(out / manifest.model_file), manifest, "train", coords[DP], layout.dp,
                           data, reads=inputs_read(out, manifest, coords[PP]))
    dp_mesh = groups.mesh_of(layout.grad_axis)  # the ranks averaging gradients: dp, or dp x cp under --cp
    masters: dict[int, torch.Tensor] = {}
    reader = _resume_reader(checkpoint, manifest, out, steps)
    if layout.pp == 1:
        module = code.RankModule(groups, device)
        module.return_outputs = False  # training needs the loss alone
        runner = _prepare(code, module, out / entry.weights, "", layout, dp_mesh, masters, reader, entry, compile)
        params, step_fn, held, finish = list(runner.parameters()), _plain_step(runner), {"": module}, None
    else:
        params, step_fn, held, finish = _pipeline(code, entry, manifest, layout, groups, out, device, rank,
                                                  dp_mesh, masters, reader, compile)
    names = {id(p): prefix + name for prefix, m in held.items() for name, p in m.named_parameters()}
    if layout.ep > 1:  # after the dp (and tied-weight) gradient sums: the experts' own, over edp
        _check_experts_left_alone(held, entry, layout)
        if layout.zero != 1:  # at ZeRO 1 the experts' distributed optimizer reduce-scatters them over edp
            finish = _with_expert_sync(finish, _expert_parameters(held, entry), groups[EDP], layout.dp)
    if layout.ep > 1:  # expert parameters differ between dp ranks: ZeRO 1 shards their state over edp only
        expert_ids = {id(p) for p in _expert_parameters(held, entry)}
        dense = [p for p in params if id(p) not in expert_ids]
        experts = [p for p in params if id(p) in expert_ids]
        edp_zero = 1 if layout.zero == 1 else 0  # FSDP2 (ZeRO 2/3) leaves experts whole
        opt = ExpertSplitOptimizer(  # experts: summed over edp, divided by dp (as sync_expert_grads)
            make_optimizer(dense, optim, layout.zero, groups[DP], _masters_of(dense, masters),
                           names=[names[id(p)] for p in dense]),
            make_optimizer(experts, optim, edp_zero, groups[EDP], _masters_of(experts, masters),
                           names=[names[id(p)] for p in experts], average_over=layout.dp))
    else:
        opt = make_optimizer(params, optim, layout.zero if layout.replicas > 1 else 0, groups[layout.grad_axis],
                             masters=[masters[id(p)] for p in params] if masters else None,
                             names=[names[id(p)] for p in params])
    masters.clear()  # the optimizer keeps what it owns (at ZeRO 1 its dp share); free the rest
    if layout.zero == 1 and layout.replicas > 1 and optim.overlap_param_gather:
        # each bucket's all-gather waited for just before its first use in the next forward; a compiled forward
        # is one graph, so its module waits for all of its buckets before it runs
        opt.gather_before_use(list(held.values()), per_submodule=not compile)
    if reader is not None:
        from fxshard.train.checkpoint import load_optimizer

        load_optimizer(reader, opt, held, entry, groups[layout.grad_axis], groups.get(EDP))
    if reader is not None:  # replayed by step until checkpoints keep the data position
        batches.load_state_dict({"format": 1, "position": reader.step * optim.grad_accum * batches.spec.rows})
    return _Run(manifest, layout, entry, coords, groups, device, batches, params, step_fn, held, finish, opt,
                _norm_weights(held, entry, manifest, layout), 1 + (reader.step if reader else 0),
                getattr(code, "count_tokens", None), bool(compile))


def _train_step(run: _Run, step: int, optim: OptimConfig, probe: MemoryProbe | None) -> float:
    """The batches of one optimizer step, their gradients averaged, clipped and applied; the step's loss."""
    set_context(step, f"training step {step}")
    manifest, layout, accum = run.manifest, run.layout, optim.grad_accum
    dp_rank, dp = run.coords[DP], layout.dp
    batches = [next(run.batches) for _ in range(accum)]
    rows = run.batches.local_rows
    microbatches = manifest.pipeline.microbatches if layout.pp > 1 else 1
    counting = contextlib.nullcontext()
    if run.count_tokens is not None:  # a token-mean loss: the step's count, from the whole step's batches
        counted = _dp_sum(sum(_count_tokens(run.count_tokens, b, manifest, rows) for b in batches),
                          run.groups[DP], run.device)
        counting = step_tokens(counted, accum * microbatches * layout.replicas)  # cp ranks: parts of each row
    value = 0.0
    # compiled: the rank files' collectives run in the graph, unguarded; the whole mesh's heartbeats say who stopped
    phase_group = dist.group.WORLD if run.compiled else run.groups[layout.grad_axis]
    with counting, named_phase(_torch_issued(layout, step, run.compiled), phase_group):
        for number, batch in enumerate(batches, (step - 1) * accum):
            leaves = [_to_rank(v, run.device, layout) for v in flatten_batch(batch, manifest.inputs, rows)]
            begin_batch(manifest.seed, number, dp_rank * rows)  # dropout masks of this batch
            value += run.step_fn(leaves) / accum
    divisor = accum * microbatches
    if divisor > 1:  # gradients summed over batches and microbatches: average them
        for p in run.params:
            if p.grad is not None:
                p.grad.div_(divisor)
    if run.finish is not None:
        with trace.span("tied and split-backward gradient sums", "step"):
            run.finish()
    if layout.replicas > 1:  # under --cp each rank's loss is its share of its rows' tokens: averaged over dp x cp
        value = _dp_mean(value, run.groups[layout.grad_axis], run.device)
    if probe is not None:
        probe.after_backward(run.params)
    sharded = layout.zero == 1 and layout.replicas > 1  # fxshard's distributed optimizer
    if sharded:
        with trace.span("ZeRO-1 gradient reduce-scatter", "step"):
            run.opt.reduce_gradients()  # each rank's shard of the averaged gradients
    if optim.clip_grad_norm is not None:
        pairs = run.opt.grad_pieces({id(p): w for p, w in run.weighted}) if sharded else \
            [(local(p.grad), w) for p, w in run.weighted if p.grad is not None]
        clip_grad_norm_(pairs, optim.clip_grad_norm)
    with named_phase(f"the optimizer step's parameter exchange over dp in training step {step}",
                     run.groups[layout.grad_axis]):
        with trace.span("optimizer step", "step"):
            run.opt.step()  # ZeRO 1 all-gathers the updated parameters
    if probe is not None:
        probe.after_step(run.opt)
    run.opt.zero_grad(set_to_none=True)
    return value


def _torch_issued(layout: Layout, step: int, compiled: bool = False) -> str:
    """What torch itself communicates in a training step (fxshard's own collectives name their lines, except
    inside torch.compile's graphs, where no Python runs around them)."""
    what = {0: "DDP's bucketed gradient all-reduce over dp", 1: "ZeRO 1's bucket reduce-scatters and all-gathers over dp",
            2: "FSDP2's parameter all-gathers and gradient reduce-scatters over dp (ZeRO 2)",
            3: "FSDP2's parameter all-gathers and gradient reduce-scatters over dp (ZeRO 3)"}[layout.zero]
    what = what if layout.replicas > 1 else ""
    if compiled:
        # tp's collectives run inside the graphs; pp's schedule and ep's exchanges run eagerly, guarded
        inside = ("the rank files' collectives over tp inside the torch.compile graphs (--compile: run without it "
                  "to have the failing one named with its line)")
        what = f"{inside}{', or ' + what if what else ''}" if layout.tp > 1 else what
    return (what or "the step's communication") + f" in training step {step}"


def _count_tokens(count: Callable, batch, manifest: Manifest, rows: int) -> int:
    """The targets a token-mean loss counts in this dp rank's ``rows`` of a batch: ``count`` runs on each
    microbatch-sized run of rows (the shapes it was compiled for)."""
    leaves = flatten_batch(batch, manifest.inputs, rows)
    rows = next((i.microbatch_shape[0] for i in manifest.inputs if i.is_tensor and i.microbatch_shape), None)
    total = next((v.shape[0] for v in leaves if isinstance(v, torch.Tensor) and v.dim()), None)
    if rows is None or total is None or rows == total:
        return int(count(*leaves))
    return sum(int(count(*[v[i:i + rows] if isinstance(v, torch.Tensor) and v.dim() else v for v in leaves]))
               for i in range(0, total, rows))


def _trained_state(held: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's trained tensors, keyed as in its weights file; ZeRO 2/3 shards gathered over dp."""
    state = {}
    for prefix, module in held.items():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            state[prefix + name] = t.detach().cpu().clone()
    return state


def _resume_reader(checkpoint, manifest: Manifest, out: Path, steps: int):
    """The checkpoint to resume from (checked against the compiled model), or None."""
    if checkpoint is None or not checkpoint.resume:
        return None
    from fxshard.train.checkpoint import CheckpointError, CheckpointReader

    reader = CheckpointReader(checkpoint.folder)
    reader.check_model(manifest, out)
    if reader.step >= steps:
        raise CheckpointError(f"{reader.path} is at step {reader.step}; --steps {steps} leaves nothing to run "
                              f"(--steps counts from the start: pass more than {reader.step})")
    return reader


def _prepare(code, module, weights: Path, prefix: str, layout, dp_mesh, masters: dict, reader=None,
             entry: RankEntry | None = None, compile: str | None = None) -> torch.nn.Module:
    """Load a generated module's weights and attach data parallelism; return what runs it.

    Under mixed precision the weights load into fp32 parameters first, so the fp32 master weights
    are exact: FSDP2 (ZeRO 2/3) keeps them as its shards; otherwise ``masters`` gets an fp32 copy of
    each parameter (keyed by ``id``) and the module's parameters become the compute dtype.  With ``compile`` (the
    CPU matrix products' kernel; None: eager) the module's forward is compiled in place, inside DDP's or FSDP2's
    hooks."""
    if layout.mixed:
        promote(module)
    load_state(module, weights, prefix=prefix)
    if reader is not None:  # --resume: the trained values (fp32 masters under bf16) replace the compiled ones
        from fxshard.train.checkpoint import load_parameters

        load_parameters(reader, module, entry, prefix)
    if layout.mixed:
        params = _needing_masters(module, layout, entry, prefix)
        masters.update(zip(map(id, params), split_masters(params, layout.compute_dtype), strict=True))
    if compile:
        from fxshard.runtime.compiled import compile_module

        compile_module(module, regional=compiled_regionally(layout), cpu_matmul=compile)
    return trace_ddp(code.attach_data_parallel(module, dp_mesh)) if layout.replicas > 1 else module


def compiled_regionally(layout) -> bool:
    """Whether ``--compile`` compiles each repeated block on its own (:func:`fxshard.runtime.compiled.compile_module`):
    under ZeRO 3, whose FSDP2 units gather each block's parameters around it, and under ``--ep`` with ``--recompute``,
    where torch's checkpoint under compile cannot hold the graph breaks at a block's expert exchanges and so runs
    eagerly around each compiled block (which then runs again in backward)."""
    return (layout.replicas > 1 and layout.zero == 3) or (layout.ep > 1 and layout.recompute != "none")


def _needing_masters(module, layout, entry: RankEntry | None, prefix: str) -> list[torch.nn.Parameter]:
    """The parameters that get an fp32 master copy under mixed precision: all of them, except under FSDP2 (ZeRO 2/3,
    whose fp32 shards are the masters) those it manages; the experts of an expert-parallel layer, which it leaves
    alone, still need theirs."""
    if not (layout.replicas > 1 and layout.zero >= 2):
        return list(module.parameters())
    return [p for name, p in module.named_parameters() if entry is not None and entry.tensors[prefix + name].axis == EP]


def _masters_of(params: list, masters: dict[int, torch.Tensor]) -> list[torch.Tensor] | None:
    """The fp32 masters of ``params`` (mixed precision, parameters not sharded by FSDP2), else None."""
    return [masters[id(p)] for p in params] if params and all(id(p) in masters for p in params) else None


def _to_rank(v, device, layout):
    """A batch input of this dp rank on ``device``, floating inputs in the compute dtype."""
    if not isinstance(v, torch.Tensor):
        return v
    v = v.to(device, non_blocking=True)
    return v.to(layout.compute_dtype) if layout.mixed and v.is_floating_point() else v


def _local_parameter_count(held: dict, entry: RankEntry) -> int:
    """Ψ of this rank: elements of its (tp- and pp-local) parameters, before any dp sharding."""
    return sum(math.prod(t.shape) for key, t in entry.tensors.items()
               if t.kind == "parameter" and any(key.startswith(prefix) for prefix in held))


def _norm_weights(held: dict, entry: RankEntry, manifest: Manifest, layout) -> list[tuple[torch.nn.Parameter, float]]:
    """Each local parameter with the weight of its gradient's squares in the global norm (1/copies)."""
    copies = {t.fqn: len(t.stages) for t in manifest.tied_across_stages}
    out = []
    for prefix, module in held.items():
        for name, p in module.named_parameters():
            t = entry.tensors[prefix + name]
            w = 1.0 / copies.get(t.source, 1)
            if t.placements[TP] == Replicate():
                w /= layout.tp  # the same gradient on every tp rank (experts under --ep too: whole on each tp rank)
            if layout.zero == 1 and layout.replicas > 1:
                pass  # the distributed optimizer's pieces: each element on one rank of its dp (edp) group
            elif t.axis == EP:
                w /= layout.size(EDP)  # the same gradient on the ranks holding the same experts
            elif layout.replicas > 1 and layout.zero == 0:
                w /= layout.replicas  # DDP: the same (averaged) gradient on every dp (x cp) rank
            out.append((p, w))
    return out


def _dp_sum(count: int, group, device) -> int:
    """A count summed over the dp ranks (each counted its own rows)."""
    from fxshard.runtime.guard import guarded

    if dist.get_world_size(group) == 1:
        return count
    t = torch.tensor(count, dtype=torch.int64, device=device)
    with guarded("all_reduce of the step's counted tokens over dp", group):
        dist.all_reduce(t, group=group)
    return int(t)


def _dp_mean(value: float, group, device) -> float:
    """The step loss averaged over the dp ranks (each saw 1/dp of the batch)."""
    from fxshard.runtime.guard import guarded

    t = torch.tensor(value, dtype=torch.float64, device=device)
    with guarded("all_reduce of the step loss over dp", group):
        dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


def _plain_step(module):
    def step(leaves) -> float:
        loss = module(*leaves)[0]
        loss.backward()
        return float(loss.detach())

    return step


def check_accumulated_loss(out: Path, manifest: Manifest, grad_accum: int) -> None:
    """Refuse ``--grad-accum K > 1`` for a model whose loss adds a load-balancing loss (two whole-batch means):
    each accumulated batch would compute it on its own batch (:func:`fxshard.compiler.check_router_loss`)."""
    if grad_accum > 1:
        from fxshard.compiler import check_router_loss

        model = load_model_file(out / manifest.model_file).build_model(manifest.seed, meta=True)  # its config
        check_router_loss(model, grad_accum, f"--grad-accum {grad_accum}", "each accumulated batch would compute "
                          "on its own and the step average", "or use --grad-accum 1 (a larger batch per step instead)")


def _expert_parameters(held: dict[str, torch.nn.Module], entry: RankEntry) -> list[torch.nn.Parameter]:
    """The parameters the manifest records split over ep (this rank's experts), in module order."""
    return [p for prefix, module in held.items() for name, p in module.named_parameters()
            if entry.tensors[prefix + name].axis == EP]


def _check_experts_left_alone(held: dict[str, torch.nn.Module], entry: RankEntry, layout: Layout) -> None:
    """Every expert parameter escaped DDP / FSDP2 (the generated ``ignore=``): else DDP would have broadcast
    dp rank 0's experts over the others' at construction, and averaged their gradients over dp."""
    for prefix, module in held.items():
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        for name, p in module.named_parameters():
            if entry.tensors[prefix + name].axis != EP:
                continue
            if hasattr(p, "to_local") or (layout.dp > 1 and layout.zero == 0 and name not in ignored):
                raise FxshardError(f"{prefix}{name}: an expert parameter of this ep rank was handed to data "
                                   "parallelism, which would overwrite or average it across ep ranks; this is a "
                                   "bug in fxshard's generated attach_data_parallel: please report it")


def _with_expert_sync(finish: Callable | None, experts: list, edp_group, dp: int) -> Callable:
    def both() -> None:
        if finish is not None:
            finish()
        sync_expert_grads(experts, edp_group, dp)

    return both


def _pipeline(code, entry: RankEntry, manifest: Manifest, layout, groups: dict, out: Path, device, rank: int, dp_mesh,
              masters: dict, reader=None, compile: str | None = None):
    """Build this rank's stage modules, their PipelineStages and the schedule.

    Returns the parameters to optimize, the step (forward + backward of one batch), the generated
    modules by weight-key prefix, and ``finish`` (once per optimizer step: the dp average of gradients a
    split-backward schedule hid from DDP, then the tied-weight gradient sums)."""
    from torch.nn.parallel import DistributedDataParallel

    from fxshard.runtime.data_parallel import DDP_BUCKET_MB
    from fxshard.runtime.pipeline import (
        all_reduce_grads,
        make_schedule,
        pipeline_stage,
        run_schedule,
        split_backward_stages,
        step_loss,
    )

    modules, runners = {}, {}
    for st in entry.stages:
        module = getattr(code, st.class_name)(groups, device)
        runners[st.index] = _prepare(code, module, out / entry.weights, st.class_name + ".", layout, dp_mesh,
                                     masters, reader, entry, compile)
        modules[st.index] = module
    stages = [pipeline_stage(runners[s], s, layout.num_stages, device, groups[PP], generated=m)
              for s, m in sorted(modules.items())]
    microbatches = manifest.pipeline.microbatches
    schedule = make_schedule(layout.schedule, stages, microbatches)
    coords = layout.coords(rank)
    last = layout.rank_of(coords.replace(pp=layout.stage_rank(layout.num_stages - 1)))
    params = [p for m in runners.values() for p in m.parameters()]  # stages never share a Parameter object

    def step(leaves) -> float:
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        losses = run_schedule(schedule, stages, microbatches, tensors, groups[PP])
        return step_loss(losses, last, groups[PP], device)

    # DDP cannot see the weight gradients of a split (zero-bubble) backward: average them here, once
    unsynced = [runners[s.stage_index] for s in split_backward_stages(schedule, stages)
                if isinstance(runners[s.stage_index], DistributedDataParallel)]

    def finish() -> None:  # once per optimizer step, after every accumulated backward
        for ddp in unsynced:
            all_reduce_grads(ddp.module, ddp.process_group, DDP_BUCKET_MB << 20)
        code.sync_tied_grads(modules, groups)

    held = {f"Stage{s}.": m for s, m in modules.items()}
    return params, step, held, finish
