"""Tier 1: the layout-invariant dropout mask (``fxshard/runtime/random.py``), single process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxshard.ir.placement import SliceSpec, take
from fxshard.runtime.random import ReferenceDropout, begin_batch, begin_microbatch, dropout, keep_mask


@pytest.fixture(autouse=True)
def _batch():
    begin_batch(seed=0, number=0)
    yield
    begin_batch(seed=0, number=0)


SHAPE = (4, 6, 12)


@pytest.mark.parametrize("dim,parts,blocks", [(0, 2, 1), (1, 2, 1), (1, 3, 1), (2, 2, 1), (2, 4, 1), (2, 2, 3),
                                             (1, 2, 3), (2, 4, 3)])
def test_mask_of_a_shard_is_the_slice_of_the_full_mask(dim, parts, blocks):
    full = keep_mask(SHAPE, 0.3, site=2)
    for index in range(parts):
        sl = SliceSpec(dim, index, parts, blocks)
        local_shape = take(torch.empty(SHAPE), sl).shape
        shard = (dim, index, parts, blocks) if blocks > 1 else (dim, index, parts)
        assert torch.equal(keep_mask(local_shape, 0.3, site=2, shard=shard), take(full, sl)), (sl, shard)


def test_replicated_mask_is_the_full_mask_and_deterministic():
    assert torch.equal(keep_mask(SHAPE, 0.3, site=1), keep_mask(SHAPE, 0.3, site=1, shard=None))


def test_dp_ranks_and_microbatches_take_their_rows_of_the_batch_mask():
    full = keep_mask(SHAPE, 0.5, site=0)  # the whole batch of 4 on one device
    for dp_rank in range(2):  # 2 dp ranks x 2 microbatches of 1 sample
        begin_batch(seed=0, number=0, first_row=dp_rank * 2)
        for mb in range(2):
            begin_microbatch(mb)
            row = dp_rank * 2 + mb
            assert torch.equal(keep_mask((1, *SHAPE[1:]), 0.5, site=0), full[row:row + 1])


def test_masks_differ_across_sites_batches_samples_and_seeds():
    base = keep_mask(SHAPE, 0.5, site=0)
    assert not torch.equal(base, keep_mask(SHAPE, 0.5, site=1))
    assert not torch.equal(base[0], base[1])  # samples of one batch
    begin_batch(seed=0, number=1)
    assert not torch.equal(base, keep_mask(SHAPE, 0.5, site=0))
    begin_batch(seed=1, number=0)
    assert not torch.equal(base, keep_mask(SHAPE, 0.5, site=0))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_p(p):
    n = 64 * 128 * 32
    kept = keep_mask((64, 128, 32), p, site=3).float().mean().item()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5


def test_dropout_scales_kept_elements_like_torch():
    x = torch.randn(SHAPE, requires_grad=True)
    y = dropout(x, 0.25, site=0)
    keep = keep_mask(SHAPE, 0.25, site=0)
    torch.testing.assert_close(y, torch.where(keep, x / 0.75, 0.0), rtol=1e-6, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, keep.float() / 0.75)
    assert dropout(x, 0.0, site=0) is x
    assert not dropout(x, 1.0, site=0).any()


def test_in_place_dropout_writes_its_input():
    x = torch.randn(SHAPE)
    want = dropout(x, 0.25, site=0)
    assert dropout(x, 0.25, site=0, inplace=True) is x
    assert torch.equal(x, want)


def test_reference_mode_numbers_training_calls_in_order():
    x = torch.randn(SHAPE)
    drop = torch.nn.Dropout(0.2)
    with ReferenceDropout():
        a = drop(x)  # site 0
        b = F.dropout(x, 0.3, training=False)  # off: no site
        c = F.dropout(x, p=0.3)  # site 1
        d = torch.dropout(x, 0.4, True)  # site 2
    assert torch.equal(a, dropout(x, 0.2, site=0))
    assert b is x or torch.equal(b, x)
    assert torch.equal(c, dropout(x, 0.3, site=1))
    assert torch.equal(d, dropout(x, 0.4, site=2))


def test_mask_shapes_run_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = dropout(torch.empty(2, 3, 8), 0.1, site=0, shard=(2, 1, 2))
    assert tuple(y.shape) == (2, 3, 8)
