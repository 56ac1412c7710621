"""ZeRO 1's distributed optimizer against torch's AdamW on whole tensors, on a real gloo group.

Parameters of odd sizes in buckets of 64 bytes (16 fp32 elements: parameters cross shard boundaries, share
buckets, and buckets are padded), each rank with its own gradients: after every step the parameters must equal torch's
``AdamW(foreach=False)`` stepped on the averaged gradient, with weight decay, bit for bit; each step issues one
reduce-scatter and one all-gather per bucket.
"""

from __future__ import annotations

import pytest
import torch
from harness import spawn

SHAPES = [(3, 5), (7,), (2, 2, 3), (1,), (4, 4)]


def _compare(rank: int, world: int, dtype: str):
    import torch.distributed as dist

    from fxshard.runtime.distributed_optimizer import DistributedOptimizer
    from fxshard.train.optim import OptimConfig

    config = OptimConfig(lr=0.05, weight_decay=0.1)
    torch.manual_seed(0)
    start = [torch.randn(s) for s in SHAPES]
    low = getattr(torch, dtype)
    mine = [torch.nn.Parameter(t.clone().to(low)) for t in start]
    masters = [t.clone() for t in start] if low != torch.float32 else None
    opt = DistributedOptimizer(mine, config, dist.group.WORLD, masters, bucket_bytes=64)
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    ref_opt = config.make(ref)
    calls = []
    for step in range(3):
        grads = [[torch.randn(s, generator=torch.Generator().manual_seed(100 * step + 10 * r + i)).to(low)
                  for i, s in enumerate(SHAPES)] for r in range(world)]
        for p, g in zip(mine, grads[rank], strict=True):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad += g  # accumulate into the bucket views, as autograd does
        for i, p in enumerate(ref):  # the average as the reduce-scatter sums it: each rank's part divided first
            p.grad = sum((grads[r][i] / world for r in range(1, world)), grads[0][i] / world).float()
        counted = {"reduce_scatter": 0, "all_gather": 0}
        real = dist.reduce_scatter_single, dist.all_gather_single

        def count(kind, fn):
            def wrapped(*a, **k):
                counted[kind] += 1
                return fn(*a, **k)
            return wrapped

        dist.reduce_scatter_single, dist.all_gather_single = count("reduce_scatter", real[0]), count("all_gather", real[1])
        try:
            opt.reduce_gradients()
            opt.step()
        finally:
            dist.reduce_scatter_single, dist.all_gather_single = real
        opt.zero_grad()
        ref_opt.step()
        calls.append(counted)
        want = [p.detach().to(low) for p in ref]
        assert all(torch.equal(a.detach(), b) for a, b in zip(mine, want, strict=True)), (step, mine, want)
    return {"buckets": len(opt.buckets), "calls": calls}


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_adamw_equals_torch_adamw_on_whole_tensors(dtype):
    results = spawn(_compare, 2, dtype)
    buckets = results[0]["buckets"]
    assert buckets >= 2  # 54 elements (fp32: 5 buckets, bf16: 2) in buckets of at most 64 bytes
    for r in results:
        assert all(c == {"reduce_scatter": buckets, "all_gather": buckets} for c in r["calls"]), r["calls"]
