"""Tier 2: the vocab-parallel cross entropy (``fxshard/runtime/tensor_parallel.py``) on real gloo groups.

Each rank holds its columns of the logits; ``vocab_cross_entropy_parts`` -> ``rt.all_gather`` ->
``vocab_cross_entropy`` must give ``torch.nn.functional.cross_entropy`` of the whole logits, and the
gradient of each rank's columns must be that columns' slice of the whole gradient, for every reduction
and with ignored targets: in fp32 within 1e-6 relative.  bf16 logits are reduced in fp32 (as Megatron-LM
does by default), so in bf16 the loss and gradient must be the fp32 cross entropy of the same logits
rounded to bf16 (1e-2 relative), and no further from it than torch's own bf16 cross entropy is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import spawn

N, C = 24, 40  # tokens, classes (divisible by 2 and 4)
CASES = [(reduction, dtype) for reduction in ("mean", "sum", "none") for dtype in (torch.float32, torch.bfloat16)]


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, C, generator=g) * 4).to(dtype)
    target = torch.randint(0, C, (N,), generator=g)
    target[::5] = -100  # ignored tokens
    return logits, target


def _loss_and_grads(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from fxshard import runtime as rt

    group = dist.group.WORLD
    out = {}
    for reduction, dtype in CASES:
        logits, target = _inputs(dtype)
        mine = logits.chunk(world, dim=1)[rank].clone().requires_grad_(True)
        start, end = rank * C // world, (rank + 1) * C // world
        parts = rt.vocab_cross_entropy_parts(mine, target, start=start, end=end)
        loss = rt.vocab_cross_entropy(rt.all_gather(parts, group, dim=1), target, ignore_index=-100,
                                      reduction=reduction, dtype=dtype)
        loss.sum().backward()
        out[reduction, dtype] = (loss.detach(), mine.grad)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_equals_cross_entropy_of_whole_logits(world):
    results = spawn(_loss_and_grads, world)
    for reduction, dtype in CASES:
        logits, target = _inputs(dtype)
        want, want_grad = _cross_entropy(logits.float(), target, reduction)
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        for rank, result in enumerate(results):
            loss, grad = result[reduction, dtype]
            assert loss.dtype == grad.dtype == dtype
            torch.testing.assert_close(loss.float(), want, **tol, msg=f"{reduction} {dtype} rank {rank} loss")
            torch.testing.assert_close(grad.float(), want_grad.chunk(world, dim=1)[rank], **tol,
                                       msg=f"{reduction} {dtype} rank {rank} grad")
        assert torch.all(want_grad[::5] == 0)  # the ignored tokens get no gradient, as whole
        if dtype == torch.bfloat16:
            torch_loss, torch_grad = _cross_entropy(logits, target, reduction)  # single-device bf16
            ours = torch.cat([r[reduction, dtype][1] for r in results], dim=1).float()
            assert (ours - want_grad).abs().max() <= (torch_grad.float() - want_grad).abs().max()
            ours_loss = results[0][reduction, dtype][0].float()
            assert (ours_loss - want).abs().max() <= (torch_loss.float() - want).abs().max()


def _masked_rank(rank: int, world: int) -> tuple:
    """Logits whose last rank's classes are all -inf (a padded vocabulary): that rank's logsumexp is -inf."""
    import torch.distributed as dist

    from fxshard import runtime as rt

    logits, target = _inputs(torch.float32)
    logits[:, C - C // world:] = float("-inf")
    target = target.masked_fill(target >= C - C // world, 0)
    mine = logits.chunk(world, dim=1)[rank].clone().requires_grad_(True)
    parts = rt.vocab_cross_entropy_parts(mine, target, start=rank * C // world, end=(rank + 1) * C // world)
    loss = rt.vocab_cross_entropy(rt.all_gather(parts, dist.group.WORLD, dim=1), target)
    loss.backward()
    return loss.detach(), mine.grad, logits, target


@pytest.mark.distributed
def test_a_rank_whose_classes_are_all_masked_gets_zero_gradient_not_nan():
    results = spawn(_masked_rank, 2)
    logits, target = results[0][2], results[0][3]
    want, want_grad = _cross_entropy(logits, target, "mean")
    for rank, (loss, grad, _, _) in enumerate(results):
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        assert not grad.isnan().any(), f"rank {rank}"
        torch.testing.assert_close(grad, want_grad.chunk(2, dim=1)[rank], rtol=1e-6, atol=1e-6)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str):
    logits = logits.detach().requires_grad_(True)
    loss = F.cross_entropy(logits, target, ignore_index=-100, reduction=reduction)
    loss.sum().backward()
    return loss.detach(), logits.grad
