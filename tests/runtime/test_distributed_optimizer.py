"""ZeRO 1's distributed optimizer against torch's AdamW on whole tensors, on a real gloo group.

Parameters of odd sizes in buckets of 64 bytes (16 fp32 elements: parameters cross shard boundaries, share
buckets, and buckets are padded), each rank with its own gradients: after every step the parameters must equal torch's
``AdamW(foreach=False)`` stepped on the averaged gradient, with weight decay, bit for bit; each step issues one
reduce-scatter and one all-gather per bucket.  With the all-gathers left in flight after the step (the overlap
with the next forward, ``fxshard run``'s default), the hooks wait for each bucket in forward order and training
is bitwise the same as with the gathers waited for in the step.
"""

from __future__ import annotations

import pytest
import torch
from harness import spawn

from fxshard.testing import matrix

SHAPES = [(3, 5), (7,), (2, 2, 3), (1,), (4, 4)]


def _compare(rank: int, world: int, dtype: str):
    import torch.distributed as dist

    import fxshard.runtime.distributed_optimizer as module
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

        def count(kind, fn):
            def wrapped(*a, **k):
                counted[kind] += 1
                return fn(*a, **k)
            wrapped.__wrapped__ = fn
            return wrapped

        module._all_gather = count("all_gather", module._all_gather)  # torch's, chosen at import
        module._reduce_scatter = count("reduce_scatter", module._reduce_scatter)
        try:
            opt.reduce_gradients()
            opt.step()
        finally:
            module._all_gather, module._reduce_scatter = (module._all_gather.__wrapped__,
                                                          module._reduce_scatter.__wrapped__)
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


def _record_waits(opt, into: list[int]) -> None:
    """Append to ``into`` each bucket whose in-flight all-gather ``opt`` waits for, in the order it does."""
    real = opt._wait

    def wait(k: int) -> None:
        if k in opt._pending:
            into.append(k)
        real(k)

    opt._wait = wait


class _Block(torch.nn.Module):
    def forward(self, x):
        return x + sum(p.sum() for p in self.parameters())


def _deferred(rank: int, world: int, folder: str):
    """The same steps gathered in place (reference) and left in flight (deferred), with a forward between steps."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from fxshard.runtime import trace
    from fxshard.runtime.distributed_optimizer import DistributedOptimizer, finish_param_sync
    from fxshard.train.optim import OptimConfig

    config = OptimConfig(lr=0.05, weight_decay=0.1)
    torch.manual_seed(0)
    start = [torch.randn(s) for s in SHAPES]
    models, opts = [], []
    for _ in range(2):
        model = torch.nn.Sequential(_Block(), _Block())
        for j, t in enumerate(start):  # 3 parameters in the first block, 2 in the second
            model[j * 2 // len(start)].register_parameter(f"p{j}", torch.nn.Parameter(t.clone()))
        models.append(model)
        opts.append(DistributedOptimizer(list(model.parameters()), config, dist.group.WORLD, bucket_bytes=64))
    ref, mine = opts
    mine.gather_before_use([models[1]])
    trace.start(rank, Path(folder))
    waited, in_flight, losses = [], [], []
    _record_waits(mine, waited)
    for step in range(3):
        out = [m(torch.zeros(())) for m in models]  # the deferred model's hooks wait for its buckets, in order
        losses.append([float(o.detach()) for o in out])
        for m in models:
            for i, p in enumerate(m.parameters()):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + 10 * rank + i))
        for o in opts:
            o.reduce_gradients()
            o.step()
            o.zero_grad()
        in_flight.append(mine.gathers_in_flight)
    finish_param_sync(mine)
    trace.save()
    events = json.loads((Path(folder) / f"rank{rank}.json").read_text())["traceEvents"]
    same = all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))
    return {"buckets": len(mine.buckets), "in_flight": in_flight, "waited": waited, "same": same, "losses": losses,
            "after": mine.gathers_in_flight, "events": [(e["name"], e["tid"]) for e in events if e["ph"] == "X"]}


@pytest.mark.distributed
def test_deferred_gathers_are_in_flight_after_the_step_and_waited_in_forward_order(tmp_path):
    """Left in flight (gather_before_use), the all-gathers are still pending when step() returns; the next
    forward's pre-hooks wait for each bucket before the block using it runs, first bucket first; the values are
    bitwise those of gathers waited for in the step, and the trace shows each gather from issue to completion."""
    results = spawn(_deferred, 2, str(tmp_path))
    for r in results:
        n = r["buckets"]
        assert n >= 2 and r["in_flight"] == [list(range(n))] * 3 and r["after"] == []
        assert r["waited"] == list(range(n)) * 3  # the forwards of steps 2 and 3, then finish_param_sync: in order
        assert r["same"] and all(a == b for a, b in r["losses"]), r["losses"]
        dp_row = [name for name, tid in r["events"] if tid == 1]
        assert sorted(dp_row) == sorted(f"all_gather (ZeRO-1 bucket {k}, issued by the step)" for k in range(n)
                                        for _ in range(3))
        waits = [name for name, tid in r["events"] if tid == 0 and name.startswith("the wait for")]
        assert len(waits) == 3 * n


def _train_twice(rank: int, world: int, out: str, optim):
    """``fxshard run``'s training of ``out`` with the gathers waited in the step and left in flight; then, in
    flight, what is pending after each step and which buckets each next forward waited for, in order."""
    import dataclasses
    from pathlib import Path

    from fxshard.train.launch import open_stream, train
    from fxshard.train.options import RunOptions
    from fxshard.train.program import Program

    results = {}
    for overlap in (False, True):
        state: dict = {}
        config = dataclasses.replace(optim, overlap_param_gather=overlap)
        results[overlap] = train(Path(out), RunOptions(STEPS, config), log=lambda *_: None, final_state=state), state
    program = Program(Path(out), RunOptions(STEPS, optim), torch.device("cpu"))
    data = open_stream(program, "train")
    waited: list[int] = []
    _record_waits(program._opt, waited)
    pending, waits = [], []
    for _ in range(STEPS):
        program.step(next(data))
        pending.append(program._opt.gathers_in_flight)
        waits.append(list(waited))
        waited.clear()
    with program:  # the end of the block waits for the last step's gathers
        pass
    return {"results": results, "buckets": len(program._opt.buckets), "pending": pending, "waits": waits,
            "after_close": program._opt.gathers_in_flight}


STEPS = 3
OVERLAP_CASES = {  # id -> (sample, layout, optimizer settings)
    "gpt-dp2-9-buckets": ("gpt.py", dict(dp=2, zero=1), dict(zero_bucket_mb=0.25, weight_decay=0.1,
                                                             clip_grad_norm=0.05)),
    "gpt-dp2-pp2-bf16-buckets": ("gpt.py", dict(dp=2, pp=2, zero=1, dtype="bf16"), dict(zero_bucket_mb=0.1)),
    "llama-dp2-tp2-buckets": ("llama.py", dict(dp=2, tp=2, zero=1), dict(zero_bucket_mb=0.05)),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(sorted(OVERLAP_CASES), ["llama-dp2-tp2-buckets"]))
def test_overlapped_parameter_gathers_train_bitwise_as_gathers_in_the_step(case, tmp_path, samples):
    """fxshard run's training with each bucket's all-gather left in flight after the step (the default) and with
    it waited for in the step (--no-overlap-param-gather): the same losses and trained parameters, bit for bit.
    In flight, every bucket is still pending when a step returns, and the next forward waits for all of them,
    in bucket order (the generated module's own parameters first, then its blocks in call order); closing the program
    (``with program:``) waits for the last step's."""
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout
    from fxshard.train.optim import OptimConfig

    sample, layout, optim = OVERLAP_CASES[case]
    layout = Layout(**layout)
    compile_model(samples / sample, layout, out=tmp_path)
    per_rank = spawn(_train_twice, layout.world_size, str(tmp_path), OptimConfig(**optim), timeout=480)
    for r in per_rank:
        (plain, plain_state), (overlapped, overlapped_state) = r["results"][False], r["results"][True]
        assert overlapped == plain
        assert plain_state.keys() == overlapped_state.keys()
        assert all(torch.equal(plain_state[k], overlapped_state[k]) for k in plain_state)
        n = r["buckets"]
        assert n >= 2 and r["pending"] == [list(range(n))] * STEPS
        assert r["waits"] == [[]] + [list(range(n))] * (STEPS - 1)
        assert r["after_close"] == []  # nothing in flight once the program is closed: the group can be destroyed
