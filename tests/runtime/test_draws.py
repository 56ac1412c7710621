"""Tier 1: layout-invariant random draws (``fxshard/runtime/draws.py``), single process.

A rank's draw is its slice of one device's: its rows of the step's batch (dp ranks x microbatches, in order), its tp
slice; every op of ``DRAWS`` draws its distribution; ``ReferenceDraws`` gives an unmodified model those values, in
the order the compile numbers them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxshard.ir.placement import SliceSpec, take
from fxshard.runtime.draws import DRAWS, ReferenceDraws, draw
from fxshard.runtime.random import begin_batch, begin_microbatch

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _batch():
    begin_batch(seed=0, number=0)
    yield
    begin_batch(seed=0, number=0)


def _like(shape):
    return torch.empty(shape)


OPS = {  # id -> (op, arguments of a [4, 6, 5] draw, the dimension of its rows)
    "rand": (aten.rand.default, lambda s: ([*s],)),
    "randn": (aten.randn.default, lambda s: ([*s],)),
    "randint": (aten.randint.low, lambda s: (3, 9, [*s])),
    "rand_like": (aten.rand_like.default, lambda s: (_like(s),)),
    "randn_like": (aten.randn_like.default, lambda s: (_like(s),)),
    "bernoulli_": (aten.bernoulli_.float, lambda s: (_like(s), 0.3)),
    "exponential_": (aten.exponential_.default, lambda s: (_like(s),)),
    "normal_": (aten.normal_.default, lambda s: (_like(s), 1.0, 2.0)),
    "uniform_": (aten.uniform_.default, lambda s: (_like(s), -1.0, 1.0)),
    "bernoulli(p)": (aten.bernoulli.default, lambda s: (torch.linspace(0, 1, s[-1]).expand(*s).contiguous(),)),
    "normal(mean)": (aten.normal.Tensor_float, lambda s: (torch.arange(float(s[-1])).expand(*s).contiguous(), 0.5)),
}
SHAPE = (4, 6, 5)


@pytest.mark.parametrize("op", list(OPS))
def test_each_dp_rank_and_microbatch_draws_its_rows_of_one_devices_values(op):
    func, args = OPS[op]
    full = draw(func, *args(SHAPE), site=3)
    for dp_rank in range(2):  # 2 dp ranks x 2 microbatches of 1 row
        begin_batch(seed=0, number=0, first_row=dp_rank * 2)
        for mb in range(2):
            begin_microbatch(mb)
            row = dp_rank * 2 + mb
            part = draw(func, *args((1, *SHAPE[1:])), site=3, rows=(0, 1, 4))
            if op in ("bernoulli(p)", "normal(mean)"):  # their tensor of probabilities or means is the part's too
                part = draw(func, args(SHAPE)[0][row:row + 1].clone(), *args(SHAPE)[1:], site=3, rows=(0, 1, 4))
            assert torch.equal(part, full[row:row + 1]), (op, dp_rank, mb)


@pytest.mark.parametrize("dim,parts,blocks", [(1, 2, 1), (2, 5, 1), (1, 3, 2)])
def test_a_tp_slice_is_the_slice_of_one_devices_draw(dim, parts, blocks):
    full = draw(aten.randn.default, [*SHAPE], site=1)
    shape = (*SHAPE[:dim], SHAPE[dim] // parts, *SHAPE[dim + 1:])
    for index in range(parts):
        shard = (dim, index, parts, blocks) if blocks > 1 else (dim, index, parts)
        part = draw(aten.randn.default, [*shape], site=1, shard=shard)
        assert torch.equal(part, take(full, SliceSpec(dim, index, parts, blocks))), (index, shard)


def test_rows_along_another_dimension_and_flattened_tokens():
    full = draw(aten.rand.default, [6, 4, 3], site=0)  # [S, B, H]: the rows in dimension 1
    begin_batch(seed=0, number=0, first_row=2)
    assert torch.equal(draw(aten.rand.default, [6, 2, 3], site=0, rows=(1, 2, 2)), full[:, 2:])
    begin_batch(seed=0, number=0)
    tokens = draw(aten.randn.default, [4 * 6, 3], site=0)  # [B*S, H]: each row's 6 tokens
    begin_batch(seed=0, number=0, first_row=2)
    assert torch.equal(draw(aten.randn.default, [2 * 6, 3], site=0, rows=(0, 2, 2)), tokens[12:])


def test_draws_differ_across_sites_streams_batches_and_seeds():
    base = draw(aten.rand.default, [64], site=0)
    assert not torch.equal(base, draw(aten.rand.default, [64], site=1))
    begin_batch(seed=0, number=1)
    assert not torch.equal(base, draw(aten.rand.default, [64], site=0))
    begin_batch(seed=1, number=0)
    assert not torch.equal(base, draw(aten.rand.default, [64], site=0))
    begin_batch(seed=0, number=0)
    assert torch.equal(base, draw(aten.rand.default, [64], site=0))  # deterministic


def test_the_distributions():
    n = [200_000]
    u = draw(aten.rand.default, n, site=0)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    z = draw(aten.randn.default, n, site=1)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    e = draw(aten.exponential_.default, torch.empty(n), 2.0, site=2)
    assert e.min() > 0 and abs(e.mean() - 0.5) < 0.01 and torch.isfinite(e.log()).all()
    k = draw(aten.bernoulli_.float, torch.empty(n), 0.3, site=3)
    assert set(k.unique().tolist()) == {0.0, 1.0} and abs(k.mean() - 0.3) < 0.01
    r = draw(aten.randint.low, -3, 4, n, site=4)
    assert r.dtype == torch.int64 and r.min() == -3 and r.max() == 3
    b16 = draw(aten.rand.default, n, dtype=torch.bfloat16, site=5)
    assert b16.dtype == torch.bfloat16 and b16.max() < 1  # as many bits as bf16 holds: never rounded up to 1


def test_randperm_is_a_permutation_and_multinomial_draws_each_row():
    assert sorted(draw(aten.randperm.default, 50, site=0).tolist()) == list(range(50))
    probs = F.softmax(torch.randn(8, 5), -1)
    probs[:, 0] = 0
    probs /= probs.sum(-1, keepdim=True)
    without = draw(aten.multinomial.default, probs, 3, site=1)
    assert without.shape == (8, 3) and (without != 0).all()
    assert all(len(set(row.tolist())) == 3 for row in without)  # without replacement
    many = draw(aten.multinomial.default, probs[:1].expand(20_000, 5).contiguous(), 1, True, site=2)
    freq = torch.bincount(many.flatten(), minlength=5).float() / 20_000
    assert torch.allclose(freq, probs[0], atol=0.015), (freq, probs[0])


def test_the_reference_draws_every_op_in_call_order():
    def forward(x):
        a = torch.rand(4, 3)
        b = torch.empty(4, 3).exponential_()
        c = torch.randn_like(x)
        return a, b, c

    with ReferenceDraws():
        a, b, c = forward(torch.zeros(4, 3))
    assert torch.equal(a, draw(aten.rand.default, [4, 3], site=0))
    assert torch.equal(b, draw(aten.exponential_.default, torch.empty(4, 3), site=1))
    assert torch.equal(c, draw(aten.randn_like.default, torch.zeros(4, 3), site=2))
    torch.manual_seed(0)
    own = torch.Generator().manual_seed(1)
    with ReferenceDraws():  # a model's own generator: torch draws it, as the compile leaves it
        assert torch.equal(torch.rand(3, generator=own), torch.rand(3, generator=torch.Generator().manual_seed(1)))


def test_every_op_drawn_is_an_op_torch_tags_random():
    assert all(torch.Tag.nondeterministic_seeded in op.tags for op in DRAWS)
