"""``rt.fp8_linear_tp`` on two ranks (threads) is the one-device fp8 linear: every scale the whole tensor's.

Where a rank's values are whole products on one device (a column-parallel output's columns, a row-parallel input
gradient's columns, every weight gradient's part) they are equal bit for bit; partial sums (a row-parallel output,
a column-parallel input gradient) agree to fp32 rounding.  A per-feature amax of features tp splits must stay each
rank's own: all-reducing it too mixes rank 0's feature i with rank 1's (an error the loss tolerances cannot see).
"""

from __future__ import annotations

import pytest
import torch
from threaded_group import ThreadedGroup, run_cases

from fxshard.runtime import fp8 as rt_fp8
from fxshard.testing import case_result

TOKENS, IN, OUT = 24, 64, 32


def _threaded_max(amaxes, group, what, site):
    every = group.exchange([a.clone() for a in amaxes])
    return [torch.stack([mine[i] for mine in every]).amax(0) for i in range(len(amaxes))]


def _inputs():
    g = torch.Generator().manual_seed(0)  # not the global one: the rank threads draw at once
    x = torch.randn(TOKENS, IN, generator=g) * torch.linspace(0.1, 20, IN)  # unlike ranges
    # features 1e6 apart, so a scale from another rank's feature would push this one's into e4m3's subnormals
    w = torch.randn(OUT, IN, generator=g) * torch.logspace(-3, 3, OUT)[:, None] * torch.logspace(-3, 3, IN)
    grad = torch.randn(TOKENS, OUT, generator=g) * 1e-2
    # the two halves of the tokens 1e6 apart likewise, the input large where the gradient is small: under "rows" (tp
    # splits the tokens) the weight gradient's scales are over all of them, so each half's small values underflow,
    # as on one device; a scale over one rank's half alone keeps them, and their products are the largest
    apart = torch.cat([torch.full((TOKENS // 2, 1), 1e-3), torch.full((TOKENS - TOKENS // 2, 1), 1e3)])
    return x / apart, w, grad * apart


def _rank(group, recipe: str, split: str):
    x, w, grad = _inputs()
    r = group.rank()
    if split == "out":
        x, w, grad = x.clone(), w.chunk(2)[r].clone(), grad.chunk(2, dim=-1)[r].clone()
    elif split == "rows":  # sequence parallelism's shard into a linear tp leaves whole
        x, w, grad = x.chunk(2)[r].clone(), w.clone(), grad.chunk(2)[r].clone()
    else:
        x, w = x.chunk(2, dim=-1)[r].clone(), w.chunk(2, dim=-1)[r].clone()
    x.requires_grad_()
    w.requires_grad_()
    y = rt_fp8.fp8_linear_tp(x, group, w, None, recipe, split)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", list(rt_fp8.RECIPES))
@pytest.mark.parametrize("split", ["out", "in", "rows"])
def test_fp8_linear_tp_is_the_one_device_linear(monkeypatch, recipe, split):
    monkeypatch.setattr(rt_fp8, "_reduced", _threaded_max)
    x, w, grad = _inputs()
    x.requires_grad_()
    w.requires_grad_()
    y = rt_fp8.fp8_linear(x, w, None, recipe)
    y.backward(grad)
    (rank0, rank1), = run_cases(_rank, 2, [("case", (recipe, split))]).values()

    def close(parts, whole):  # a sum of parts: fp32's rounding; rowwise products come out in bf16 (torchao's)
        bits = 8 if rt_fp8.RECIPES[recipe].rowwise else 22
        atol = 4 * 2.0**-bits * float(whole.detach().abs().max())
        torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=atol)

    if split == "out":  # column-parallel: output columns and weight rows whole; input gradient a partial sum
        assert torch.equal(torch.cat([rank0[0], rank1[0]], dim=-1), y)
        assert torch.equal(torch.cat([rank0[2], rank1[2]]), w.grad)
        close((rank0[1], rank1[1]), x.grad)
    elif split == "rows":  # tokens split: output and input-gradient rows whole; the weight gradient a partial sum
        assert torch.equal(torch.cat([rank0[0], rank1[0]]), y)
        assert torch.equal(torch.cat([rank0[1], rank1[1]]), x.grad)
        close((rank0[2], rank1[2]), w.grad)
    else:  # row-parallel: input-gradient and weight columns whole; the output a partial sum
        assert torch.equal(torch.cat([rank0[1], rank1[1]], dim=-1), x.grad)
        assert torch.equal(torch.cat([rank0[2], rank1[2]], dim=-1), w.grad)
        close((rank0[0], rank1[0]), y)


BATCH, SEQ, LINEARS = 2, 12, 3  # a [2, 12, 64] input, the sp shards [2, 6, 64]: three column-parallel linears read it


def _fused_or_not(group, recipe: str, fused: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, IN, generator=g) * torch.linspace(0.1, 20, IN)
    ws = [torch.randn(OUT, IN, generator=g) * torch.logspace(-3, 3, OUT)[:, None] for _ in range(LINEARS)]
    bs = [torch.randn(OUT, generator=g) for _ in range(LINEARS)]
    grads = [torch.randn(BATCH, SEQ, OUT, generator=g) * 1e-2 for _ in range(LINEARS)]
    r = group.rank()
    ws = [w.chunk(2)[r].clone().requires_grad_() for w in ws]  # column-parallel: this rank's output features
    bs = [b.chunk(2)[r].clone().requires_grad_() for b in bs]
    grads = [t.chunk(2, dim=-1)[r] for t in grads]
    gathered = x.clone().requires_grad_()  # gather_to's output; its input, the sp shard, is this rank's tokens
    if fused:
        ys = rt_fp8.fp8_linears_regathered(gathered, group, x.chunk(2, dim=1)[r].clone(), 1, tuple(ws), tuple(bs),
                                           recipe)
    else:
        ys = [rt_fp8.fp8_linear_tp(gathered, group, w, b, recipe, "out") for w, b in zip(ws, bs, strict=True)]
    torch.autograd.backward(list(ys), grads)
    return [y.detach() for y in ys], gathered.grad, [w.grad for w in ws], [b.grad for b in bs]


@pytest.mark.parametrize("recipe", list(rt_fp8.RECIPES))
def test_fp8_linears_regathered_is_the_unfused_linears_bit_for_bit(monkeypatch, recipe):
    """Under --sp the overlap pass fuses the fp8 linears reading a gather_to into one ``rt.fp8_linears_regathered``,
    which keeps the shard and gathers it again in backward: every output and gradient on every rank equals the
    unfused ``fp8_linear_tp`` calls', bit for bit (the same casts of the same values, the same sums)."""
    monkeypatch.setattr(rt_fp8, "_reduced", _threaded_max)
    found = run_cases(_fused_or_not, 2, [("fused", (recipe, True)), ("unfused", (recipe, False))])
    for rank in range(2):
        fused, unfused = found["fused"][rank], found["unfused"][rank]
        for a, b in zip(torch.utils._pytree.tree_leaves(fused), torch.utils._pytree.tree_leaves(unfused), strict=True):
            assert torch.equal(a, b), (recipe, rank)


class _SubGroup(ThreadedGroup):
    """Some ranks of a threaded world (a tp group inside cp x tp): its own barrier, ranks numbered among ``members``."""

    def __init__(self, members: list[int]):
        super().__init__(len(members))
        self.members, self.parent = members, None

    def rank(self) -> int:
        return self.members.index(self.parent.rank())


CP, TP = 2, 2  # mesh (cp, tp), tp innermost: rank r is cp r // 2, tp r % 2


def _cp_tp_rank(world, tp_groups, recipe: str, amaxes_over_cp: bool):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, SEQ, IN, generator=g) * torch.linspace(0.1, 20, IN)
    x[:, SEQ // CP:] *= 1e3  # the second cp rank's tokens far larger: a scale over one cp rank's tokens is not one device's
    ws = [torch.randn(OUT, IN, generator=g) * torch.logspace(-3, 3, OUT)[:, None] for _ in range(LINEARS)]
    grads = [torch.randn(BATCH, SEQ, OUT, generator=g) * 1e-2 for _ in range(LINEARS)]
    c, t = divmod(world.rank(), TP)
    tp = tp_groups[c]
    tp.parent = world
    mine = x.chunk(CP, dim=1)[c]  # this cp rank's tokens
    ws = [w.chunk(TP)[t].clone().requires_grad_() for w in ws]  # column-parallel: this tp rank's output features
    grads = [gr.chunk(CP, dim=1)[c].chunk(TP, dim=-1)[t] for gr in grads]
    gathered = mine.clone().requires_grad_()  # gather_to's output over tp; its input, tp's sp shard of cp's tokens
    ys = rt_fp8.fp8_linears_regathered(gathered, tp, mine.chunk(TP, dim=1)[t].clone(), 1, tuple(ws),
                                       (None,) * LINEARS, recipe, amax_group=world if amaxes_over_cp else tp)
    torch.autograd.backward(list(ys), grads)
    return [y.detach() for y in ys], [w.grad for w in ws]


def test_fp8_linears_regathered_under_cp_scale_over_every_cp_and_tp_rank(monkeypatch):
    """Under ``--cp`` with ``--tp --sp`` (llama3.1-405b's recipe) the fused fp8 linears gather over tp and all-reduce
    their amaxes over cp x tp: each output (this cp rank's tokens, this tp rank's features) equals one device's bit
    for bit, and each weight gradient's cp parts sum to one device's.  Amaxes over tp alone (the cp ranks' own
    tokens) fail it."""
    monkeypatch.setattr(rt_fp8, "_reduced", _threaded_max)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, SEQ, IN, generator=g) * torch.linspace(0.1, 20, IN)
    x[:, SEQ // CP:] *= 1e3
    ws = [torch.randn(OUT, IN, generator=g) * torch.logspace(-3, 3, OUT)[:, None] for _ in range(LINEARS)]
    grads = [torch.randn(BATCH, SEQ, OUT, generator=g) * 1e-2 for _ in range(LINEARS)]
    ws = [w.requires_grad_() for w in ws]
    ys = [rt_fp8.fp8_linear(x, w, None, "tensorwise") for w in ws]
    torch.autograd.backward(ys, grads)
    for over_cp in (True, False):
        tp_groups = [_SubGroup([c * TP + t for t in range(TP)]) for c in range(CP)]
        ranks = case_result(run_cases(_cp_tp_rank, CP * TP, [("case", (tp_groups, "tensorwise", over_cp))]), "case")
        outputs_equal = all(torch.equal(ranks[c * TP + t][0][i], ys[i].chunk(CP, dim=1)[c].chunk(TP, dim=-1)[t])
                            for c in range(CP) for t in range(TP) for i in range(LINEARS))
        assert outputs_equal == over_cp, over_cp
        if over_cp:
            for t in range(TP):
                for i in range(LINEARS):
                    whole = ws[i].grad.chunk(TP)[t]
                    torch.testing.assert_close(ranks[t][1][i] + ranks[TP + t][1][i], whole, rtol=0,
                                               atol=4 * 2.0**-22 * float(whole.abs().max()))
