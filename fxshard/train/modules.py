"""This rank's generated modules, set up to train: process groups, weights, data parallelism, pipeline stages.

:class:`fxshard.train.program.Program` asks :func:`build_rank` for what one rank runs; the optimizer comes from
:func:`build_optimizer`.  Nothing here loops over steps or reads data.  The order of set-up matters and is the
same on every rank: every ``new_group`` is collective over the world, DDP broadcasts at construction, FSDP2 and
ZeRO 1 copy the parameters they are given, so the weights are loaded (and under mixed precision promoted to
fp32) before any of them wraps the module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fxshard.codegen.manifest import Manifest, RankEntry
from fxshard.errors import FxshardError, LayoutError
from fxshard.ir.layout import EDP, EP, PP, TP, Layout
from fxshard.ir.placement import Replicate
from fxshard.runtime import load_state
from fxshard.runtime.data_parallel import make_optimizer
from fxshard.runtime.dp_trace import trace_ddp
from fxshard.runtime.experts import sync_expert_grads
from fxshard.runtime.guard import named_phase
from fxshard.runtime.mixed_precision import promote, split_masters
from fxshard.train.optim import ExpertSplitOptimizer, OptimConfig


@dataclass
class RankModules:
    """What this rank runs: its parameters, how one local batch trains and evaluates, and its modules."""

    params: list[torch.nn.Parameter]
    train_fn: Callable  # leaves -> loss (float) of one local batch; backward done
    eval_fn: Callable  # leaves -> loss (float) of one local batch, forward only
    held: dict[str, torch.nn.Module]  # weight-key prefix ("" or "StageN.") -> generated module
    finish: Callable | None  # once per optimizer step, after every backward (tied, split-backward, expert sums)
    masters: dict[int, torch.Tensor]  # id(parameter) -> fp32 master under mixed precision (freed by the optimizer)
    microbatches: int  # the pipeline's microbatches per batch (1 without pipelining)


def build_groups(layout: Layout, manifest: Manifest, device: torch.device):
    """Every process group this rank's program uses (:meth:`fxshard.ir.layout.Layout.process_groups`), and the dp
    sub-mesh data parallelism is attached over."""
    with named_phase("start-up: the process groups of the dp x pp x tp mesh"):
        groups = layout.process_groups(device.type, {t.name: t.stages for t in manifest.tied_across_stages})
    return groups, groups.mesh_of(layout.grad_axis)  # the ranks averaging gradients: dp, or dp x cp under --cp


def build_rank(code, out: Path, manifest: Manifest, entry: RankEntry, groups: dict, dp_mesh, device,
               compile: str | None = None) -> RankModules:
    """This rank's generated modules with their compiled weights, wrapped for data parallelism (and under
    pipelining, its stages and schedule).  ``compile``: None (eager) or the compiled CPU matrix products' kernel."""
    layout = manifest.layout
    masters: dict[int, torch.Tensor] = {}
    if layout.pp == 1:
        module = code.RankModule(groups, device)
        module.return_outputs = False  # training needs the loss alone
        runner = _prepare(code, module, out / entry.weights, "", layout, dp_mesh, masters, entry, compile)
        rank = RankModules(trained_parameters(runner), _plain_step(runner), _plain_eval(runner), {"": module}, None,
                           masters, 1)
    else:
        rank = _pipeline(code, entry, manifest, layout, groups, out, device, dp_mesh, masters, compile)
    if layout.ep > 1:  # after the dp (and tied-weight) gradient sums: the experts' own, over edp
        _check_experts_left_alone(rank.held, entry, layout)
        if layout.zero != 1:  # at ZeRO 1 the experts' distributed optimizer reduce-scatters them over edp
            rank.finish = _with_expert_sync(rank.finish, expert_parameters(rank.held, entry), groups[EDP],
                                            layout.replicas)
    return rank


def build_optimizer(rank: RankModules, entry: RankEntry, layout: Layout, groups: dict, optim: OptimConfig):
    """AdamW over this rank's parameters as the layout needs it (ZeRO 1: fxshard's distributed optimizer over dp;
    under --ep the experts' share over edp), weight decay by :meth:`OptimConfig.decayed`."""
    held, params, masters = rank.held, rank.params, rank.masters
    names = {id(p): prefix + name for prefix, m in held.items() for name, p in m.named_parameters()}
    decayed = {id(p): optim.decayed(entry.tensors[names[id(p)]].global_shape) for p in params}

    def make(ps, zero, group, **kw):
        return make_optimizer(ps, optim, zero, group, _masters_of(ps, masters), names=[names[id(p)] for p in ps],
                              decayed=[decayed[id(p)] for p in ps], **kw)

    if layout.ep > 1:  # expert parameters differ between dp ranks: ZeRO 1 shards their state over edp only
        expert_ids = {id(p) for p in expert_parameters(held, entry)}
        dense = [p for p in params if id(p) not in expert_ids]
        experts = [p for p in params if id(p) in expert_ids]
        edp_zero = 1 if layout.zero == 1 else 0  # FSDP2 (ZeRO 2/3) leaves experts whole
        opt = ExpertSplitOptimizer(  # experts: summed over edp, divided by dp (x cp) as sync_expert_grads
            make(dense, layout.zero, groups[layout.grad_axis]),
            make(experts, edp_zero, groups[EDP], average_over=layout.replicas))
    else:
        opt = make(params, layout.zero if layout.replicas > 1 else 0, groups[layout.grad_axis])
    masters.clear()  # the optimizer keeps what it owns (at ZeRO 1 its dp share); free the rest
    return opt


def compiled_regionally(layout) -> bool:
    """Whether ``--compile`` compiles each repeated block on its own (:func:`fxshard.runtime.compiled.compile_module`):
    under ZeRO 3, whose FSDP2 units gather each block's parameters around it, and under ``--ep`` with ``--recompute``,
    where torch's checkpoint under compile cannot hold the graph breaks at a block's expert exchanges and so runs
    eagerly around each compiled block (which then runs again in backward)."""
    return (layout.replicas > 1 and layout.zero == 3) or (layout.ep > 1 and layout.recompute != "none")


def check_accumulated_loss(out: Path, manifest: Manifest, grad_accum: int) -> None:
    """Refuse ``--grad-accum K > 1`` for a model whose loss adds a load-balancing loss (two whole-batch means):
    each accumulated batch would compute it on its own batch (:func:`fxshard.compiler.check_router_loss`)."""
    if grad_accum > 1 and manifest.batch_couplings:
        raise LayoutError(f"--grad-accum {grad_accum}: {'; '.join(manifest.batch_couplings)} mixes the examples "
                          "of the whole batch (its statistics, or every example against every other), which "
                          "accumulated batches each compute on their own part; use --grad-accum 1 (a larger batch "
                          "per step, over --dp, instead)")
    if grad_accum > 1:
        from fxshard.capture.modelfile import load_model_file
        from fxshard.compiler import check_router_loss

        model = load_model_file(out / manifest.model_file).build_model(manifest.seed, meta=True)  # its config
        check_router_loss(model, grad_accum, f"--grad-accum {grad_accum}", "each accumulated batch would compute "
                          "on its own and the step average", "or use --grad-accum 1 (a larger batch per step instead)")


def _prepare(code, module, weights: Path, prefix: str, layout, dp_mesh, masters: dict, entry: RankEntry,
             compile: str | None = None) -> torch.nn.Module:
    """Load a generated module's weights and attach data parallelism; return what runs it.

    Under mixed precision the weights load into fp32 parameters first, so the fp32 master weights
    are exact: FSDP2 (ZeRO 2/3) keeps them as its shards; otherwise ``masters`` gets an fp32 copy of
    each parameter (keyed by ``id``) and the module's parameters become the compute dtype.  With ``compile`` (the
    CPU matrix products' kernel; None: eager) the module's forward is compiled in place, inside DDP's or FSDP2's
    hooks."""
    if layout.mixed:
        promote(module)
    load_state(module, weights, prefix=prefix)
    if layout.mixed:
        params = _needing_masters(module, layout, entry, prefix)
        masters.update(zip(map(id, params), split_masters(params, layout.compute_dtype), strict=True))
        if not (layout.replicas > 1 and layout.zero >= 2):  # FSDP2 gathers its shards in the compute dtype itself
            with torch.no_grad():  # frozen: the compute dtype, as one device's recipe, and no master
                for p in module.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(layout.compute_dtype)
    if compile:
        from fxshard.runtime.compiled import compile_module

        compile_module(module, regional=compiled_regionally(layout), cpu_matmul=compile)
    return trace_ddp(code.attach_data_parallel(module, dp_mesh)) if layout.replicas > 1 else module


def _needing_masters(module, layout, entry: RankEntry | None, prefix: str) -> list[torch.nn.Parameter]:
    """The parameters that get an fp32 master copy under mixed precision: all of them, except under FSDP2 (ZeRO 2/3,
    whose fp32 shards are the masters) those it manages; the experts of an expert-parallel layer, which it leaves
    alone, still need theirs."""
    if not (layout.replicas > 1 and layout.zero >= 2):
        return trained_parameters(module)
    return [p for name, p in module.named_parameters()
            if p.requires_grad and entry is not None and entry.tensors[prefix + name].axis == EP]


def trained_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: a frozen one (``requires_grad=False`` in the model, generated so) gets no
    gradient, no optimizer state and no master copy at any layout or ZeRO stage; it is still loaded and saved."""
    return [p for p in module.parameters() if p.requires_grad]


def _masters_of(params: list, masters: dict[int, torch.Tensor]) -> list[torch.Tensor] | None:
    """The fp32 masters of ``params`` (mixed precision, parameters not sharded by FSDP2), else None."""
    return [masters[id(p)] for p in params] if params and all(id(p) in masters for p in params) else None


def local_parameter_count(held: dict, entry: RankEntry) -> int:
    """Ψ of this rank: elements of its (tp- and pp-local) parameters, before any dp sharding."""
    return sum(math.prod(t.shape) for key, t in entry.tensors.items()
               if t.kind == "parameter" and any(key.startswith(prefix) for prefix in held))


def norm_weights(held: dict, entry: RankEntry, manifest: Manifest, layout) -> list[tuple[torch.nn.Parameter, float]]:
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


def _plain_step(module):
    def step(leaves) -> float:
        loss = module(*leaves)[0]
        loss.backward()
        return float(loss.detach())

    return step


def _plain_eval(module):
    def evaluate(leaves) -> float:
        with torch.no_grad():
            return float(module(*leaves)[0])

    return evaluate


def expert_parameters(held: dict[str, torch.nn.Module], entry: RankEntry) -> list[torch.nn.Parameter]:
    """The parameters the manifest records split over ep (this rank's experts), in module order."""
    return [p for prefix, module in held.items() for name, p in module.named_parameters()
            if p.requires_grad and entry.tensors[prefix + name].axis == EP]


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


def _pipeline(code, entry: RankEntry, manifest: Manifest, layout, groups: dict, out: Path, device, dp_mesh,
              masters: dict, compile: str | None = None) -> RankModules:
    """This rank's stage modules, their PipelineStages and the schedule.

    ``finish`` runs once per optimizer step: the dp average of gradients a split-backward schedule hid from DDP,
    then the tied-weight gradient sums.  Evaluation runs the same schedule forward only (``schedule.eval``)."""
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
                                     masters, entry, compile)
        modules[st.index] = module
    stages = [pipeline_stage(runners[s], s, layout.num_stages, device, groups[PP], generated=m)
              for s, m in sorted(modules.items())]
    microbatches = manifest.pipeline.microbatches
    schedule = make_schedule(layout.schedule, stages, microbatches)
    coords = layout.coords(dist.get_rank())
    last = layout.rank_of(coords.replace(pp=layout.stage_rank(layout.num_stages - 1)))
    params = [p for m in runners.values() for p in trained_parameters(m)]  # stages never share a Parameter object

    def run(leaves, train: bool) -> float:
        # a rank loads only the inputs its stages read (fxshard.train.data.inputs_read): the others are None
        named = [(i.name, v) for i, v in zip(manifest.inputs, leaves, strict=True) if isinstance(v, torch.Tensor)]
        losses = run_schedule(schedule, stages, microbatches, [v for _, v in named], groups[PP], train=train,
                              names=[n for n, _ in named])
        return step_loss(losses, last, groups[PP], device)

    # DDP cannot see the weight gradients of a split (zero-bubble) backward: average them here, once
    unsynced = [runners[s.stage_index] for s in split_backward_stages(schedule, stages)
                if isinstance(runners[s.stage_index], DistributedDataParallel)]

    def finish() -> None:  # once per optimizer step, after every accumulated backward
        for ddp in unsynced:
            all_reduce_grads(ddp.module, ddp.process_group, DDP_BUCKET_MB << 20)
        code.sync_tied_grads(modules, groups)

    held = {f"Stage{s}.": m for s, m in modules.items()}
    return RankModules(params, lambda leaves: run(leaves, True), lambda leaves: run(leaves, False), held, finish,
                       masters, microbatches)
