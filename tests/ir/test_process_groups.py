"""``Layout.process_groups``: the one builder of a rank's process groups, on real gloo groups in spawned processes."""

from __future__ import annotations

import pytest

from fxshard.ir.layout import CP, DP, DPCP, EDP, EP, PP, TP, Layout
from fxshard.testing import spawn

pytestmark = pytest.mark.distributed  # every test spawns gloo ranks


def _members(rank: int, world: int, layout: Layout, tied: dict) -> dict[str, list[int]]:
    import torch.distributed as dist

    groups = layout.process_groups("cpu", tied)
    assert dist.get_process_group_ranks(groups.mesh_of(DP).get_group()) == dist.get_process_group_ranks(groups[DP])
    return {name: dist.get_process_group_ranks(group) for name, group in groups.items()}


def _expected(layout: Layout, rank: int, tied: dict) -> dict[str, list[int]]:
    c = layout.coords(rank)
    axes = layout.mesh_axes
    along = {axis: [r for r in range(layout.world_size)
                    if all(layout.coords(r)[a] == c[a] for a in axes if a != axis)] for axis in axes}
    if layout.cp > 1:  # dp and cp flattened: the ranks at this pp and tp coordinate
        along[DPCP] = [r for r in range(layout.world_size)
                       if (layout.coords(r).pp, layout.coords(r).tp) == (c.pp, c.tp)]
    for axis, groups in (layout.expert_groups().items() if layout.ep > 1 else ()):
        along[axis] = next(g for g in groups if rank in g)
    for name, stages in tied.items():
        holders = sorted({layout.stage_rank(s) for s in stages})
        if len(holders) > 1:  # a weight whose stages all sit on one pp rank needs no group
            along[name] = [layout.rank_of(c.replace(pp=p)) for p in holders]
    return along


def test_ep_and_edp_are_unflattened_from_dp():
    """dp=4 ep=2: dp coordinate d is ep rank d % ep; the ranks holding the same experts form its edp group."""
    layout = Layout(dp=4, ep=2)
    for rank, groups in enumerate(spawn(_members, layout.world_size, layout, {})):
        assert groups == _expected(layout, rank, {}), rank
        assert set(groups) == {DP, PP, TP, EDP, EP}


def test_a_weight_tied_across_pp_ranks_gets_a_group_per_tp_coordinate():
    """tp=2 x pp=2, interleaved: stages 0 and 3 sit on pp ranks 0 and 1; stages 0 and 2 both on pp rank 0 (no group)."""
    layout = Layout(tp=2, pp=2, schedule="interleaved-1f1b")
    tied = {"tied:lm_head.weight": (0, 3), "tied:one_rank": (0, 2)}
    for rank, groups in enumerate(spawn(_members, layout.world_size, layout, tied)):
        assert groups == _expected(layout, rank, tied), rank
        assert list(groups) == [*layout.mesh_axes, "tied:lm_head.weight"]


def test_cp_sits_between_dp_and_pp_and_flattens_with_dp():
    """dp=2 cp=2 tp=2: a cp group per (dp, tp) coordinate, dp x cp flattened (the ranks averaging gradients)."""
    layout = Layout(dp=2, cp=2, tp=2)
    for rank, groups in enumerate(spawn(_members, layout.world_size, layout, {})):
        assert groups == _expected(layout, rank, {}), rank
        assert set(groups) == {DP, CP, PP, TP, DPCP}
    assert _expected(layout, 5, {})[DPCP] == [1, 3, 5, 7]


def test_cp_with_ep_spans_edp_over_cp():
    """dp=2 cp=2 ep=2: ep groups within one cp coordinate (the tokens of one part of the sequence are exchanged);
    the ranks holding the same experts (edp) are every cp rank of the same ep coordinate."""
    layout = Layout(dp=2, cp=2, ep=2)
    for rank, groups in enumerate(spawn(_members, layout.world_size, layout, {})):
        assert groups == _expected(layout, rank, {}), rank
        assert set(groups) == {DP, CP, PP, TP, DPCP, EDP, EP}
    assert layout.expert_groups() == {EP: [[0, 2], [1, 3]], EDP: [[0, 1], [2, 3]]}
    assert layout.size(EDP) == 2
