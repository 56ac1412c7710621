"""Run generated stage modules under ``torch.distributed.pipelining``.

Each generated ``StageN`` class declares what it receives and sends per microbatch (``INPUTS`` /
``OUTPUTS``: name, local shape, dtype, whether a gradient flows), so the ``PipelineStage`` is built
with static metadata: no shape-inference round trip, and a mismatch is a compile-time fact.  User inputs
(labels, masks) never cross stages: every rank has the batch, stage 0 takes it positionally and a later
stage takes the inputs it names in ``BATCH`` by keyword, from the microbatches torch's schedule splits
``step``'s keyword arguments into.  So only activations a gradient flows back through are sent, which
is what torch 2.11's ``PipelineStage`` requires (it makes every received buffer require a gradient).  The
last stage returns the microbatch loss itself (the loss is part of the compiled graph); the training
loop divides the summed gradients by the microbatch count once per optimizer step, so training matches
the full batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from fxshard.runtime import trace
from fxshard.runtime.guard import guarded
from fxshard.runtime.random import begin_microbatch

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
}
_MULTI = {"interleaved-1f1b", "zero-bubble"}


def _metas(spec) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(shape, dtype=dtype, device="meta").requires_grad_(rg) for _, shape, dtype, rg in spec)


class _Stage(PipelineStage):
    """A ``PipelineStage`` that tells dropout which microbatch it computes (``fxshard.runtime.random``).

    Every schedule runs a forward through ``forward_one_chunk`` with the microbatch's index, whatever
    order it interleaves them in, so the mask of each sample is the one it has on one device.

    ``batch``: the user inputs this stage takes by keyword (its class's ``BATCH``).  The schedule gives every stage
    the whole microbatch by keyword; the stage hands its forward those it takes, beside torch's keyword path rather
    than through it, since torch counts that path's tensors among the stage's inputs in backward (torch 2.11's
    split backward asks autograd for their gradients, which an integer tensor cannot have)."""

    def __init__(self, *args, batch: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.batch = batch
        self._taken: dict[str, torch.Tensor] = {}  # this microbatch's user inputs, during its forward

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, *rest, **more):
        begin_microbatch(fwd_chunk_id)
        self._taken = {name: kwargs[batch_key(name)] for name in self.batch} if self.batch else {}
        try:
            with trace.span(f"F{fwd_chunk_id}", "pipeline", stage=self.stage_index, microbatch=fwd_chunk_id,
                            action="F"):
                return super().forward_one_chunk(fwd_chunk_id, args, {}, *rest, **more)
        finally:
            self._taken = {}

    # the schedule's backward actions, timed under fxshard run --trace: B (full), or I then W (split backward)
    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        action = "B" if full else "I"
        with trace.span(f"{action}{bwd_chunk_id}", "pipeline", stage=self.stage_index, microbatch=bwd_chunk_id,
                        action=action):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with trace.span(f"W{bwd_chunk_id}", "pipeline", stage=self.stage_index, microbatch=bwd_chunk_id, action="W"):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    # gloo sends contiguous tensors only; a stage's output may be a strided view (T5 at pp=2 sends one:
    # "input tensor has to be contiguous") and an input's gradient may be strided the same way
    def forward_maybe_with_nosync(self, *args, **kwargs):
        out = super().forward_maybe_with_nosync(*args, **kwargs, **self._taken)
        return tuple(_contiguous(o) for o in out) if isinstance(out, tuple) else _contiguous(out)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        if bwd_chunk_id in self.bwd_cache:
            self.bwd_cache[bwd_chunk_id] = tuple(_contiguous(g) for g in self.bwd_cache[bwd_chunk_id])
        return super().get_bwd_send_ops(bwd_chunk_id)


def _contiguous(x):
    return x.contiguous() if isinstance(x, torch.Tensor) else x


def batch_key(name: str) -> str:
    """The keyword under which ``run_schedule`` passes the user input ``name`` to the schedule's ``step``: not an
    identifier, so an input named ``target`` or ``losses`` cannot collide with ``step``'s own keywords."""
    return f"batch:{name}"


def pipeline_stage(module: torch.nn.Module, index: int, num_stages: int, device, group,
                   generated: torch.nn.Module | None = None) -> PipelineStage:
    """A ``PipelineStage`` for a generated stage module (possibly wrapped for data parallelism), with the
    metadata the generated class declares."""
    generated = generated or module
    outputs = _metas(generated.OUTPUTS)
    return _Stage(module, index, num_stages, torch.device(device), input_args=_metas(generated.INPUTS),
                  output_args=outputs[0] if index == num_stages - 1 else outputs, group=group,
                  batch=tuple(getattr(generated, "BATCH", ())))


def _loss_is_output(output, target):
    return output  # the last stage computes the loss inside the compiled graph


def make_schedule(name: str, stages: list[PipelineStage], microbatches: int, cls: type | None = None):
    """torch's schedule ``name`` over this rank's ``stages`` (``cls``: a subclass of its class to build instead)."""
    cls = cls or SCHEDULE_CLASSES[name]
    # scale_grads=False: the schedule would divide the *accumulated* gradients by the microbatch count at
    # every step, which breaks gradient accumulation over steps; the training loop divides once instead
    return cls(stages if name in _MULTI else stages[0], n_microbatches=microbatches, loss_fn=_loss_is_output,
               scale_grads=False)


def run_schedule(schedule, stages: list[PipelineStage], microbatches: int, inputs: list[torch.Tensor],
                 group, train: bool = True, names: list[str] | None = None) -> list[torch.Tensor]:
    """One batch's forward and backward over all microbatches (``train=False``: forward only, without gradients,
    through the schedule's ``eval``); the microbatch losses (last stage).  ``inputs``: the batch's tensors, named
    ``names`` (the manifest's inputs), which stage 0 takes positionally and later stages by keyword."""
    losses: list[torch.Tensor] = []
    # the schedule API wants a target per microbatch; the loss needs none, so a placeholder is split
    target = torch.zeros(microbatches, device=stages[0].device)
    wanted = sorted({name for s in stages for name in getattr(s, "batch", ())})
    by_name = dict(zip(names, inputs, strict=True)) if names is not None else {}
    if any(name not in by_name for name in wanted):
        raise ValueError(f"this rank's pipeline stages take the user inputs {wanted} from the batch, which has "
                         f"{sorted(by_name)}; the rank file and manifest.json come from different compiles: recompile")
    batch = {batch_key(name): by_name[name] for name in wanted}
    inputs = inputs if any(s.is_first for s in stages) else []
    what = "activations and gradients" if train else "activations, forward only"
    with guarded(f"pipeline schedule {type(schedule).__name__} (send/recv of {what})", group, cat="schedule"), \
            _traced_p2p():
        if train:
            schedule.step(*inputs, target=target, losses=losses, return_outputs=False, **batch)
        else:
            with torch.no_grad():
                schedule.eval(*inputs, target=target, losses=losses, return_outputs=False, **batch)
    return losses


@contextlib.contextmanager
def _traced_p2p():
    """Under ``fxshard run --trace``: each batch of sends and receives torch's schedule issues between stages, and
    each wait on one, is an event (category ``p2p``: the desc torch gives it, the peers and the bytes), so the
    trace shows where a stage waits for its neighbour.  Off, nothing is touched."""
    if not trace.enabled():
        yield
        return
    from torch.distributed.pipelining import schedules

    issue = schedules._batch_p2p  # every schedule's sends and receives go through it (torch 2.13)

    def traced(p2p_ops, desc=None):
        if not p2p_ops:  # the first stage's receives of activations, the last's of gradients: nothing issued
            return issue(p2p_ops, desc)
        args = {"peers": sorted({p.peer for p in p2p_ops}),
                "bytes": sum(p.tensor.numel() * p.tensor.element_size() for p in p2p_ops)}
        name = desc or "/".join(sorted({"send" if p.op is dist.isend else "recv" for p in p2p_ops}))
        with trace.span(name, "p2p", **args):
            works = issue(p2p_ops, desc)
        return [_TracedWork(w, f"wait {name}", args) for w in works]

    schedules._batch_p2p = traced
    try:
        yield
    finally:
        schedules._batch_p2p = issue


class _TracedWork:
    """A send's or receive's ``dist.Work`` whose ``wait`` is a trace event."""

    def __init__(self, work, name: str, args: dict):
        self._work, self._name, self._args = work, name, args

    def wait(self, *a, **k):
        with trace.span(self._name, "p2p", **self._args):
            return self._work.wait(*a, **k)

    def __getattr__(self, name):
        return getattr(self._work, name)


def sum_tied_grads(copies: list[torch.nn.Parameter], group) -> None:
    """Sum the gradients of the copies of one weight (on this rank and, over ``group``, on other stages).

    Under ZeRO 2/3 the parameters and gradients are dp shards (DTensors): the copies on the pp ranks
    of one dp coordinate hold the same shard, so the local shards are summed."""
    from fxshard.runtime.data_parallel import local

    for c in copies:
        if c.grad is None:
            c.grad = torch.zeros_like(c)
    total = local(copies[0].grad).clone()
    for c in copies[1:]:
        total += local(c.grad)
    if group is not None:
        with guarded("all_reduce of a tied weight's gradient between pipeline stages", group):
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    for c in copies:
        local(c.grad).copy_(total)


def step_loss(losses: list[torch.Tensor], last_rank: int, group, device) -> float:
    """The step's loss (mean over microbatches), computed on the last stage and broadcast over ``group``."""
    value = torch.zeros((), device=device, dtype=torch.float64)
    if losses:
        value = torch.stack([x.detach().to(torch.float64) for x in losses]).mean()
    with guarded("broadcast of the step loss from the last pipeline stage", group):
        dist.broadcast(value, src=last_rank, group=group)
    return float(value)


def split_backward_stages(schedule, stages: list[PipelineStage]) -> list[PipelineStage]:
    """This rank's stages whose weight gradients the schedule computes in a separate ``W`` pass.

    Zero-bubble schedules split each backward into an input-gradient pass (I) and a weight-gradient pass
    (W); torch computes W with ``torch.autograd.grad`` and adds the result to ``.grad`` by hand, so the
    autograd hooks through which DDP all-reduces its buckets never fire for those parameters (stage 0
    runs W as a full backward, which does fire them)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    order = getattr(schedule, "pipeline_order", None) or {}
    weight = {a.stage_index for actions in order.values() for a in actions
              if a is not None and a.computation_type == _ComputationType.BACKWARD_WEIGHT}
    return [s for s in stages if s.stage_index in weight and s.stage_index != 0]


def all_reduce_grads(module: torch.nn.Module, group, bucket_bytes: int) -> None:
    """Average ``module``'s gradients over ``group`` in buckets of about ``bucket_bytes`` (flattened per
    dtype): what DDP would have done while backward ran, done once after it; the parameters DDP was told to
    ignore (the experts of an expert-parallel layer, which differ between dp ranks) are left alone, as DDP does."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    world = dist.get_world_size(group)

    def flush(bucket: list[torch.Tensor]) -> None:
        flat = _flatten_dense_tensors(bucket)
        with guarded("all_reduce of the gradients over dp (after a split-backward pipeline schedule)", group, flat):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)
        for g, r in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            g.copy_(r)

    bucket: list[torch.Tensor] = []
    held = 0  # bytes in the bucket
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    for g in (p.grad for name, p in module.named_parameters() if p.grad is not None and name not in ignored):
        size = g.numel() * g.element_size()
        if bucket and (g.dtype != bucket[0].dtype or held + size > bucket_bytes):
            flush(bucket)
            bucket, held = [], 0
        bucket.append(g)
        held += size
    if bucket:
        flush(bucket)
