"""One slice arithmetic (``fxshard/runtime/slices.py``): the ranges a part holds, cut, put back and gathered."""

from __future__ import annotations

import pytest
import torch

import fxshard.runtime.collectives as collectives
from fxshard.runtime.slices import SliceSpec, assemble, part_ranges, take


def test_part_ranges_of_a_plain_and_a_packed_split():
    assert part_ranges(8, 1, 2) == [(4, 8)]
    assert part_ranges(12, 1, 2, blocks=3) == [(2, 4), (6, 8), (10, 12)]  # [q_1, k_1, v_1]


@pytest.mark.parametrize("dim,parts,blocks", [(0, 2, 1), (1, 4, 1), (1, 2, 3), (0, 4, 3)])
def test_take_is_the_chunk_of_every_block_and_assemble_puts_the_parts_back(dim, parts, blocks):
    full = torch.arange(24 * 12).reshape(24, 12).float()
    pieces = []
    for index in range(parts):
        sl = SliceSpec(dim, index, parts, blocks)
        chunked = torch.cat([b.chunk(parts, dim)[index] for b in full.chunk(blocks, dim)], dim)
        assert torch.equal(take(full, sl), chunked)
        assert torch.equal(collectives._take(full, dim, index, parts, blocks), chunked)
        pieces.append((sl, take(full, sl)))
    assert torch.equal(assemble(pieces, full.shape), full)


@pytest.mark.parametrize("blocks", [1, 3])
def test_all_gather_puts_every_ranks_packed_blocks_back_in_place(monkeypatch, blocks):
    """Two ranks' parts of a packed q/k/v gathered: ``[q_0, q_1, k_0, k_1, v_0, v_1]``, the unsharded tensor."""
    full = torch.arange(12 * 5).reshape(12, 5).float()
    parts = [take(full, SliceSpec(0, r, 2, blocks)) for r in range(2)]
    monkeypatch.setattr(collectives.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(collectives.dist, "all_gather",
                        lambda out, x, group: [o.copy_(p) for o, p in zip(out, parts, strict=True)])
    assert torch.equal(collectives._all_gather(parts[0], None, 0, blocks, "all_gather"), full)
