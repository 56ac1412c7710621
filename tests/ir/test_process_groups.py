"""``Layout.process_groups``: the one builder of a rank's process groups, on real gloo groups in spawned processes."""

from __future__ import annotations

import pytest

from fxshard.ir.layout import DP, EDP, EP, MESH_AXES, PP, TP, Layout
from fxshard.testing import spawn

pytestmark = pytest.mark.distributed  # every test spawns gloo ranks


def _members(rank: int, world: int, layout: Layout, tied: dict) -> dict[str, list[int]]:
    import torch.distributed as dist

    groups = layout.process_groups("cpu", tied)
    assert dist.get_process_group_ranks(groups.mesh_of(DP).get_group()) == dist.get_process_group_ranks(groups[DP])
    return {name: dist.get_process_group_ranks(group) for name, group in groups.items()}


def _expected(layout: Layout, rank: int, tied: dict) -> dict[str, list[int]]:
    c = layout.coords(rank)
    along = {axis: [r for r in range(layout.world_size)
                    if all(layout.coords(r)[a] == c[a] for a in MESH_AXES if a != axis)] for axis in MESH_AXES}
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
        assert list(groups) == [*MESH_AXES, "tied:lm_head.weight"]
