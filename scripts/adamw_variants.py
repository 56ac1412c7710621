"""Which AdamW implementation `fxshard run` uses: torch's per-tensor loop, foreach or fused, on this device.

    .venv/bin/python scripts/adamw_variants.py

Each variant takes 10 steps from the same parameters and gradients (weight decay on); printed: the largest
difference from the per-tensor loop, whether it is bitwise equal, whether stepping each tensor as two halves
(a rank's shard) gives bitwise what stepping it whole gives, and the time per step.  OptimConfig.kwargs picks the
fastest variant bitwise equal to the loop.
"""

import time

import torch

SHAPES = [(256, 1024), (1024,), (1024, 256), (64,), (512, 512)]


def _train(base, grads, halves: bool, **kwargs) -> list[torch.Tensor]:
    cut = (lambda ts: [h for t in ts for h in t.chunk(2)]) if halves else (lambda ts: list(ts))
    params = [torch.nn.Parameter(t.clone()) for t in cut(base)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kwargs)
    for step in grads:
        for p, g in zip(params, cut(step), strict=True):
            p.grad = g.clone()
        opt.step()
    return [torch.cat(params[i:i + 2]) for i in range(0, len(params), 2)] if halves else params


def _ms_per_step(base, grad, **kwargs) -> float:
    params = [torch.nn.Parameter(t.clone()) for t in base]
    opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
    for p, g in zip(params, grad, strict=True):
        p.grad = g
    opt.step()
    start = time.perf_counter()
    for _ in range(20):
        opt.step()
    return (time.perf_counter() - start) / 20 * 1e3


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(10)]
    loop = _train(base, grads, False, foreach=False)
    print(f"{sum(t.numel() for t in base):,} parameters in {len(SHAPES)} tensors, 10 steps, torch {torch.__version__}")
    for name, kwargs in (("loop", dict(foreach=False)), ("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
        whole = _train(base, grads, False, **kwargs)
        halves = _train(base, grads, True, **kwargs)
        diff = max((a - b).abs().max().item() for a, b in zip(whole, loop, strict=True))
        equal = all(torch.equal(a, b) for a, b in zip(whole, loop, strict=True))
        split = all(torch.equal(a, b) for a, b in zip(halves, whole, strict=True))
        print(f"{name:8s} max |diff| from loop {diff:.1e}  bitwise equal {equal}  halves == whole {split}  "
              f"{_ms_per_step(base, grads[0], **kwargs):.2f} ms/step")


if __name__ == "__main__":
    main()
