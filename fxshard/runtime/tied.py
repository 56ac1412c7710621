"""A weight used on several pipeline stages (tied embeddings): its copies' gradients summed.

Apart from :mod:`fxshard.runtime.pipeline`, whose import loads ``torch.distributed.pipelining`` and with it
``torch._dynamo`` (about 2 s of CPU), so that a rank file without ``--pp`` does not pay for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxshard.runtime.guard import guarded


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
