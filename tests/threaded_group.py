"""A process group of threads in this process, for the fast tier's checks of the sharding rules.

``make test`` runs every rank of a rule's case as a process of a real gloo group (``fxshard.testing.spawn``);
the edit loop (``make test-fast``) runs the same generated rank files, with the same runtime collectives
(``fxshard.runtime.collectives``: the autograd Functions, their forward and backward), one thread per rank.
Only the transport is replaced: the few ``torch.distributed`` calls those collectives make (all-reduce,
all-gather, reduce-scatter, a rank and a size) exchange the ranks' tensors through shared memory, summing in
rank order.  A rule that splits wrongly is off by order 1 either way.  torch's ``LocalTensorMode`` (torch 2.13
has it) cannot run them: it runs one SPMD program on every rank, and rank files are one program per rank.
"""

from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager

import torch
import torch.distributed as dist

from fxshard.testing import CaseFailure

TIMEOUT = 120.0  # seconds a rank waits for the others at a collective before the case fails


class ThreadedGroup:
    """``world`` ranks, one thread each; a rank is the thread's ``rank`` here."""

    def __init__(self, world: int):
        self.world = world
        self._barrier = threading.Barrier(world, timeout=TIMEOUT)
        self._slots: list = [None] * world
        self._local = threading.local()

    def rank(self) -> int:
        return self._local.rank

    def size(self) -> int:
        return self.world

    def exchange(self, value) -> list:
        """Every rank's ``value``, in rank order (a collective: every rank calls it, in the same order)."""
        self._slots[self.rank()] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # all have read before the next exchange writes
        return values

    def abort(self) -> None:
        self._barrier.abort()  # the others' waits raise: a rank that failed does not hang the case


class _Done:
    def wait(self) -> bool:
        return True


def _sum(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for v in values[1:]:
        total += v
    return total


class _Transport:
    """The ``torch.distributed`` calls of ``fxshard.runtime.collectives``, over a :class:`ThreadedGroup`."""

    ReduceOp = dist.ReduceOp

    @staticmethod
    def all_reduce(x, op=dist.ReduceOp.SUM, group=None, async_op=False):
        assert op == dist.ReduceOp.SUM, op
        x.copy_(_sum(group.exchange(x.clone())))
        return _Done() if async_op else None

    @staticmethod
    def all_gather(parts, x, group=None, async_op=False):
        for part, value in zip(parts, group.exchange(x.clone()), strict=True):
            part.copy_(value)
        return _Done() if async_op else None

    @staticmethod
    def reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=None):
        assert op == dist.ReduceOp.SUM, op
        every = group.exchange([p.clone() for p in parts])
        out.copy_(_sum([mine[group.rank()] for mine in every]))

    @staticmethod
    def get_world_size(group=None) -> int:
        return group.size()

    @staticmethod
    def get_rank(group=None) -> int:
        return group.rank()


@contextmanager
def _threaded_transport():
    import fxshard.runtime.collectives as collectives
    import fxshard.runtime.fp8 as fp8  # fp8_linears_regathered's all-gather

    before = collectives.dist, fp8.dist
    collectives.dist = fp8.dist = _Transport
    try:
        yield
    finally:
        collectives.dist, fp8.dist = before


def run_cases(fn, world: int, items: list[tuple[str, tuple]]) -> dict:
    """``fn(group, *args)`` on ``world`` threads for each ``(key, args)``, as :func:`fxshard.testing.spawn_cases`
    returns it: ``{key: [result per rank]}``, or ``{key: CaseFailure}`` with every failing rank's traceback."""
    found: dict = {}
    with _threaded_transport():
        for key, args in items:
            group = ThreadedGroup(world)
            results: list = [None] * world
            errors: list[str] = []

            def rank_main(rank: int, group=group, results=results, errors=errors, args=args):
                group._local.rank = rank
                try:
                    results[rank] = fn(group, *args)
                except BaseException:
                    errors.append(f"rank {rank}:\n{traceback.format_exc()}")
                    group.abort()

            threads = [threading.Thread(target=rank_main, args=(r,), name=f"{key}-rank{r}") for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            found[key] = CaseFailure("\n".join(errors)) if errors else results
    return found
