"""The mesh's typed values: coordinates and placements, and how they read back from the manifest's JSON."""

from __future__ import annotations

import pytest

from fxshard.errors import LayoutError
from fxshard.ir.layout import CP, DP, EP, PP, TP, Coords, Layout
from fxshard.ir.placement import Partial, Replicate, Shard, placement_from_json


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2, dp=2), Layout(dp=4, ep=2, tp=2), Layout(pp=3),
                                    Layout(dp=2, cp=2, tp=2), Layout(cp=4, pp=2)])
def test_coordinates_and_ranks_are_inverse(layout):
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank_of(c) == rank == layout.rank_of(**{axis: c[axis] for axis in layout.mesh_axes})
        assert (c.cp is None) == (layout.cp == 1)
        assert c.ep == (c.dp % layout.ep if layout.ep > 1 else None)
        assert Coords.from_json(c.to_json()) == c


def test_the_innermost_axis_varies_fastest():
    layout = Layout(tp=2, pp=2, dp=2)
    assert [layout.coords(r) for r in (0, 1, 2, 4)] == [Coords(), Coords(tp=1), Coords(pp=1), Coords(dp=1)]
    assert layout.coords(3)[PP] == 1 and layout.coords(3)[TP] == 1 and layout.coords(3)[DP] == 0


def test_cp_sits_between_dp_and_pp():
    layout = Layout(dp=2, cp=2, tp=2)
    assert layout.mesh_axes == (DP, CP, PP, TP) and layout.mesh_shape == (2, 2, 1, 2) and layout.world_size == 8
    assert [layout.coords(r) for r in (1, 2, 4)] == [Coords(tp=1, cp=0), Coords(cp=1), Coords(dp=1, cp=0)]
    assert Layout(tp=2).mesh_axes == (DP, PP, TP)  # folders without --cp keep their three-axis mesh


def test_a_coordinate_of_another_axis_is_an_error():
    with pytest.raises(KeyError, match="no index on axis 'ep'"):
        Coords()[EP]  # noqa: B018
    with pytest.raises(KeyError):
        Coords()["cp"]  # noqa: B018
    with pytest.raises(ValueError, match="are not mesh coordinates"):
        Coords.from_json({"dp": 0, "pp": 0, "tp": "1"})


@pytest.mark.parametrize("placement", [Shard(0), Shard(1, blocks=3), Replicate(), Partial(), Partial("max")])
def test_placements_read_back_from_their_json(placement):
    assert placement_from_json(placement.to_json()) == placement


@pytest.mark.parametrize("data", ["Shard(0)", {"kind": "shard"}, {"kind": "shard", "dim": 0, "parts": 2},
                                  {"kind": "replicate", "dim": 0}, {"kind": "sum"}])
def test_a_placement_fxshard_does_not_write_is_refused(data):
    with pytest.raises(ValueError, match="is not a placement fxshard writes"):
        placement_from_json(data)


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"microbatches": 4}, "--microbatches 4 applies to pipeline parallelism"),
    ({"schedule": "gpipe"}, "--schedule gpipe applies to pipeline parallelism"),
    ({"schedule": "interleaved-1f1b", "virtual_stages": 2}, "--schedule interleaved-1f1b applies to pipeline"),
])
def test_a_pipelines_own_flag_without_a_pipeline_is_refused(kwargs, says):
    """Layout checks itself (no second copy in the compiler): at --pp 1 a pipeline flag is an error, not ignored."""
    with pytest.raises(LayoutError, match=rf"^{says}.*leave it unset at --pp 1$"):
        Layout(**kwargs)
    Layout(pp=2, **kwargs)  # the same flags with a pipeline
    Layout(microbatches=1, virtual_stages=1)  # the values a pipeline of one stage has anyway

