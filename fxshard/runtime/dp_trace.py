"""Under ``fxshard run --trace``: the dp collectives torch itself issues, as trace events of their own.

DDP's bucket all-reduces and FSDP2's all-gathers and reduce-scatters are not lines of the rank files (torch runs
them from hooks), so :func:`fxshard.runtime.guard.guarded` never sees them.  Traced, they become events of
category ``dp`` on a second row of the rank (``tid`` :data:`~fxshard.runtime.trace.DP_THREAD`), beside the backward
they overlap:

- DDP: a comm hook that does what DDP's built-in reducer does (divide the bucket by the group size, all-reduce
  it, asynchronously) and records the all-reduce from its issue to its completion;
- FSDP2: torch's ``foreach_all_gather`` (issue), ``foreach_all_gather_copy_out`` (wait and copy out) and
  ``foreach_reduce`` (the reduce-scatter), timed where FSDP2 calls them (``_fsdp_param_group``, torch 2.13);
- ZeRO 1's parameter all-gathers left in flight after the step (:mod:`fxshard.runtime.distributed_optimizer`), from
  their issue to their completion (:func:`traced_until_done`); the forward's wait for each is a span of the rank.

Untraced runs touch nothing: no hook is registered and no torch function is replaced.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from fxshard.runtime import trace
from fxshard.runtime.trace import DP_THREAD


def _ranks(group) -> list[int]:
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # the default group: every rank
        return list(range(dist.get_world_size()))


def trace_ddp(module: torch.nn.Module) -> torch.nn.Module:
    """Register the traced all-reduce hook on a DDP ``module`` when tracing (anything else is returned as is)."""
    from torch.nn.parallel import DistributedDataParallel

    if trace.enabled() and isinstance(module, DistributedDataParallel):
        module.register_comm_hook(module.process_group, _traced_allreduce)
    return module


def _traced_allreduce(group, bucket):  # unannotated: DDP checks annotations against real types
    """DDP's own averaging all-reduce of one bucket, recorded from issue to completion."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / group.size())  # bitwise what the built-in reducer does (a division differs at dp=3)
    args = {"bytes": buffer.numel() * buffer.element_size(), "dtype": str(buffer.dtype).removeprefix("torch."),
            "ranks": _ranks(group), "bucket": bucket.index()}
    name = f"all_reduce (DDP bucket {bucket.index()})"
    start = time.perf_counter_ns()
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

    def done(f):
        trace.interval(name, "dp", start, time.perf_counter_ns(), DP_THREAD, **args)
        return f.value()[0]

    return future.then(done)


def traced_until_done(work, name: str, start_ns: int, group, tensor: torch.Tensor, **args) -> None:
    """An asynchronous collective fxshard issued (``work``, started at ``start_ns``) as a ``dp`` event that ends
    when it completes, whoever waits for it and whenever."""
    info = {"bytes": tensor.numel() * tensor.element_size(), "dtype": str(tensor.dtype).removeprefix("torch."),
            "ranks": _ranks(group)} | args

    def done(_future) -> None:
        trace.interval(name, "dp", start_ns, time.perf_counter_ns(), DP_THREAD, **info)

    work.get_future().then(done)


@contextlib.contextmanager
def traced_fsdp():
    """While tracing: FSDP2's all-gathers and reduce-scatters are timed as ``dp`` events."""
    if not trace.enabled():
        yield
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as where

    saved = {n: getattr(where, n) for n in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")}

    def timed(name: str, fn, group_at: int, before=None, after=None):
        """``fn`` timed as one event; its bytes from its arguments ``before`` the call (foreach_reduce empties the
        list of gradients it is given) or from its result ``after`` it."""
        def call(*args, **kwargs):
            sent = before(args) if before else 0
            start = time.perf_counter_ns()
            result = fn(*args, **kwargs)
            group = args[group_at] if len(args) > group_at else None
            trace.interval(name, "dp", start, time.perf_counter_ns(), DP_THREAD,
                           bytes=sent if before else after(result), ranks=_ranks(group) if group is not None else [])
            return result

        return call

    def gathered(result) -> int:  # an AllGatherResult: its output buffer
        out = getattr(result, "all_gather_output", None) if result is not None else None
        return out.numel() * out.element_size() if out is not None else 0

    where.foreach_all_gather = timed("all_gather (FSDP2 issue)", saved["foreach_all_gather"], 1, after=gathered)
    where.foreach_all_gather_copy_out = timed("all_gather (FSDP2 wait, copy out)", saved["foreach_all_gather_copy_out"],
                                              2, before=lambda args: gathered(args[0]))
    where.foreach_reduce = timed("reduce_scatter (FSDP2)", saved["foreach_reduce"], 2,
                                 before=lambda args: sum(g.numel() * g.element_size() for g in args[1]))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(where, name, fn)
