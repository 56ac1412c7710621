"""Hardware profiles as data: the shipped ones load, a profile with missing or malformed fields is refused naming
every field, and the collective times are the ring formulas at the link each group lands on."""

from __future__ import annotations

import json
import math

import pytest

from fxshard.cost.calibrate import _fit
from fxshard.cost.hardware import hardware_names, load_hardware
from fxshard.errors import OptionError

GOOD = {"peak_flops": {"bf16": 1e15, "fp32": 6e13}, "memory_bandwidth": 3e12, "memory": "80GiB",
        "devices_per_node": 8, "intra_node": {"bandwidth": 4e11, "latency": 5e-6},
        "inter_node": {"bandwidth": 5e10, "latency": 1e-5}}


def test_the_shipped_profiles_load_with_every_field():
    assert {"h100", "h200", "b200", "a100", "cpu-gloo"} <= set(hardware_names())
    for name in hardware_names():
        hw = load_hardware(name)
        assert hw.peak("bf16") > 0 and hw.peak("fp32") > 0 and hw.memory > 0 and hw.devices_per_node >= 1
        assert hw.intra_node.bandwidth > 0 and hw.inter_node.bandwidth > 0
    assert load_hardware("h100").memory == 80 * 2**30 and load_hardware("H100").name == load_hardware("h100").name


def test_a_profile_file_loads_and_missing_fields_are_each_named(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(GOOD))
    assert load_hardware(path).inter_node.latency == 1e-5
    broken = {k: v for k, v in GOOD.items() if k not in ("memory_bandwidth", "inter_node")}
    broken["peak_flops"] = {"bf16": -1}
    path.write_text(json.dumps(broken))
    with pytest.raises(OptionError) as e:
        load_hardware(path)
    text = str(e.value)
    assert str(path) in text and "memory_bandwidth" in text and "inter_node" in text and "peak_flops" in text
    assert "fxshard calibrate" in text


@pytest.mark.parametrize("content,found", [("{not json", "expected JSON"), ("[1, 2]", "found list")])
def test_a_file_that_is_no_profile_is_refused(tmp_path, content, found):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(OptionError, match=found):
        load_hardware(path)


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(OptionError, match="h100.*calibrate"):
        load_hardware("tpu-v9")


def test_a_dtype_the_profile_lacks_is_refused_naming_it(tmp_path):
    path = tmp_path / "fp32only.json"
    path.write_text(json.dumps(GOOD | {"peak_flops": {"fp32": 1e12}}))
    with pytest.raises(OptionError, match=r"peak_flops\['bf16'\].*--dtype fp32"):
        load_hardware(path).peak("bf16")


def test_collectives_are_the_ring_formulas_on_the_link_the_group_spans():
    hw = load_hardware("h100")
    n = 2**30
    intra, inter = hw.intra_node, hw.inter_node
    # all-reduce: 2 (g-1)/g of the buffer over the bus bandwidth, plus the latency of its steps
    assert hw.collective_seconds("all_reduce", n, 8, 1) == pytest.approx(
        2 * 7 / 8 * n / intra.bandwidth + 2 * 6 * intra.latency)
    assert hw.collective_seconds("all_gather", n, 8, 1) == pytest.approx(
        hw.collective_seconds("all_reduce", n, 8, 1) / 2)
    assert hw.collective_seconds("all_reduce", n, 16, 2) == pytest.approx(
        2 * 15 / 16 * n / inter.bandwidth + 2 * 8 * inter.latency)
    assert hw.collective_seconds("all_reduce", n, 1, 1) == 0.0
    assert hw.p2p_seconds(n, 2) == pytest.approx(n / inter.bandwidth + inter.latency)


def test_a_measured_group_size_uses_its_own_fit_and_overlap_hides_its_share(tmp_path):
    """calibrate fits each group size within a node apart (on a CPU with more ranks than cores a group of 4 is far
    slower per step than a group of 2); ``overlap`` is the share of communication hidden beside compute."""
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(GOOD | {"groups": {"4": {"bandwidth": 1e8, "latency": 2e-3}}, "overlap": 0.25,
                                       "contention": 2.0}))
    hw = load_hardware(path)
    assert hw.collective_seconds("all_gather", 1e6, 4, 1) == pytest.approx(3 / 4 * 1e6 / 1e8 + 3 * 2e-3)
    assert hw.collective_seconds("all_gather", 1e6, 8, 1) == pytest.approx(7 / 8 * 1e6 / 4e11 + 6 * 5e-6)
    assert hw.collective_seconds("all_gather", 1e6, 4, 2) == pytest.approx(3 / 4 * 1e6 / 5e10 + 3 * 1e-5)
    assert hw.exposed(1.0, 0.4) == pytest.approx(0.9) and hw.exposed(1.0, 3.0) == pytest.approx(0.75)
    assert load_hardware("h100").exposed(1.0, 0.4) == pytest.approx(0.6) and hw.contention == 2.0
    path.write_text(json.dumps(GOOD | {"groups": {"four": {}}, "overlap": 1.5, "contention": 0.5}))
    with pytest.raises(OptionError) as e:
        load_hardware(path)
    assert "groups" in str(e.value) and "overlap" in str(e.value) and "contention" in str(e.value)


def test_a_collective_measured_apart_uses_its_own_fit_before_its_group_sizes(tmp_path):
    """calibrate fits each collective and group size apart too (gloo's reduce-scatter takes longer than the ring
    formula's half of its all-reduce); a collective or group size without its own fit takes the group size's, then
    the node's link; a malformed entry is named."""
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(GOOD | {"groups": {"2": {"bandwidth": 1e9, "latency": 1e-3}},
                                       "collectives": {"reduce_scatter": {"2": {"bandwidth": 2e8, "latency": 3e-3}}}}))
    hw = load_hardware(path)
    assert hw.collective_seconds("reduce_scatter", 1e6, 2, 1) == pytest.approx(1 / 2 * 1e6 / 2e8 + 1 * 3e-3)
    assert hw.collective_seconds("all_reduce", 1e6, 2, 1) == pytest.approx(2 * 1 / 2 * 1e6 / 1e9 + 2 * 1e-3)
    assert hw.collective_seconds("reduce_scatter", 1e6, 4, 1) == pytest.approx(3 / 4 * 1e6 / 4e11 + 3 * 5e-6)
    assert hw.collective_seconds("reduce_scatter", 1e6, 2, 2) == pytest.approx(1 / 2 * 1e6 / 5e10 + 1e-5)
    for bad in ({"all_reduce": {"2": {"bandwidth": -1, "latency": 0}}}, {"gossip": {}}):
        path.write_text(json.dumps(GOOD | {"collectives": bad}))
        with pytest.raises(OptionError, match="collectives .expected an object of collective .all_reduce"):
            load_hardware(path)


def test_calibrate_puts_every_rank_in_one_group_of_each_size_measured_at_once():
    """Collectives are measured under load, all groups of a size at once: every rank in exactly one group, within
    a node of consecutive ranks (as tp's), across nodes of the same local rank (as dp's over nodes)."""
    from fxshard.cost.calibrate import _inter_groups, _intra_groups

    assert _intra_groups(2, 4, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _intra_groups(4, 4, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _inter_groups(2, 2, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _inter_groups(2, 4, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _inter_groups(3, 3, 6) == [[0, 2, 4], [1, 3, 5]] and _inter_groups(3, 3, 3) == [[0, 1, 2]]
    for groups in (_intra_groups(2, 8, 16), _inter_groups(4, 4, 16), _inter_groups(2, 4, 16)):
        assert sorted(r for g in groups for r in g) == list(range(16))


def test_compute_scale_and_selective_overhead_load_and_bad_values_are_named(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(GOOD | {"compute_scale": 2.5, "selective_overhead": 3e-5}))
    hw = load_hardware(path)
    assert hw.compute_scale == 2.5 and hw.selective_overhead == 3e-5
    assert load_hardware("h100").compute_scale == 1.0 and load_hardware("h100").selective_overhead == 0.0
    path.write_text(json.dumps(GOOD | {"compute_scale": 0, "selective_overhead": -1}))
    with pytest.raises(OptionError) as e:
        load_hardware(path)
    assert "compute_scale" in str(e.value) and "selective_overhead" in str(e.value)


def test_a_fit_that_noise_bends_keeps_what_it_measured():
    """Latency-bound points (no slower with size, as small collectives beside computing ranks are) keep their
    latency, not a bandwidth through the origin that would predict a small collective 50 times too fast; points
    whose fit has a negative latency keep their bandwidth."""
    flat = _fit([("all_reduce", 4, 2**16, 5.3e-3), ("all_reduce", 4, 2**20, 4.9e-3), ("all_reduce", 4, 2**22, 4.8e-3)])
    assert flat["latency"] == pytest.approx((5.3e-3 + 4.9e-3 + 4.8e-3) / 3 / 6) and flat["bandwidth"] > 1e14
    steep = _fit([("all_gather", 2, 2**16, 1e-5), ("all_gather", 2, 2**20, 2e-3), ("all_gather", 2, 2**22, 8e-3)])
    assert steep["latency"] == 0 and 1e8 < steep["bandwidth"] < 1e9
    for fit in (flat, steep):
        assert math.isfinite(fit["bandwidth"]) and fit["bandwidth"] > 0


def test_calibrate_fits_the_ring_formula_back_from_its_points():
    bandwidth, latency = 2e8, 1e-3
    points = []
    for op, passes in (("all_reduce", 2), ("all_gather", 1), ("reduce_scatter", 1)):
        for g in (2, 4):
            steps = passes * min(g - 1, 2 * (g - 1).bit_length())
            for nbytes in (2**16, 2**20, 2**24):
                points.append((op, g, nbytes, steps * latency + passes * (g - 1) / g * nbytes / bandwidth))
    fitted = _fit(points)
    assert fitted["bandwidth"] == pytest.approx(bandwidth) and fitted["latency"] == pytest.approx(latency)


@pytest.mark.distributed
def test_calibrate_measures_two_gloo_processes_and_writes_a_profile_that_loads(tmp_path):
    from fxshard.cost.calibrate import calibrate

    out = tmp_path / "here.json"
    written = calibrate(out, procs=2, quick=True)
    hw = load_hardware(out)
    assert hw.peak("fp32") > 0 and hw.memory_bandwidth > 0 and hw.devices_per_node == 2
    assert hw.intra_node.bandwidth > 0 and hw.intra_node.latency >= 0
    points = written["measured"]["intra_node"]["points"]
    assert {p["op"] for p in points} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert {p["group"] for p in points} == {2}
    assert set(hw.groups) == {2} and set(hw.collectives) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(set(by_group) == {2} for by_group in hw.collectives.values())
    largest = max(p["bytes"] for p in points)  # 4 MiB all-reduced beside computing ranks: milliseconds, not the floor
    assert all(p["seconds"] > 1e-4 for p in points if p["bytes"] == largest and p["op"] == "all_reduce")
    assert 0 <= hw.overlap <= 1 and hw.contention >= 1 and hw.kernel_overhead > 0
    assert hw.selective_overhead >= 0 and hw.compute_scale == 1.0  # no --model: no step measured


def test_calibrate_refuses_one_process_and_a_folder(tmp_path):
    from fxshard.cost.calibrate import calibrate

    with pytest.raises(OptionError, match="at least 2 processes"):
        calibrate(tmp_path / "x.json", procs=1)
    with pytest.raises(OptionError, match="found a folder"):
        calibrate(tmp_path, procs=2)


def test_attention_efficiency_follows_the_profiles_curve_by_sequence(tmp_path):
    """Between two points of ``attention_by_seq`` linear in log2 of the length, held beyond the ends; without a
    curve the flat ``efficiency.attention``; a malformed curve is refused naming the field."""
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(GOOD | {"efficiency": {"attention": 0.4},
                                       "attention_by_seq": {"1024": 0.2, "4096": 0.3, "16384": 0.34}}))
    hw = load_hardware(path)
    assert [hw.attention_efficiency(s) for s in (256, 1024, 2048, 4096, 8192, 65536)] == pytest.approx(
        [0.2, 0.2, 0.25, 0.3, 0.32, 0.34])
    path.write_text(json.dumps(GOOD | {"efficiency": {"attention": 0.4}}))
    assert load_hardware(path).attention_efficiency(2048) == 0.4
    path.write_text(json.dumps(GOOD | {"attention_by_seq": {"long": 0.3, "512": 1.5}}))
    with pytest.raises(OptionError, match="attention_by_seq"):
        load_hardware(path)


# every field, every way a hand-edited profile goes wrong (issue 45 item 9): a NaN kernel_overhead ranked layouts
# by "nan s" and recommended one; a NaN or infinite memory was a raw error
FIELDS = {"kernel_overhead": ["NaN", "-1e-6", "Infinity", "true", '"x"'], "memory": ["NaN", "Infinity", "-5", "0"],
          "memory_bandwidth": ["NaN", "-1", "Infinity"], "devices_per_node": ["NaN", "2.5", "0"],
          "overlap": ["NaN", "1.5"], "contention": ["NaN", "Infinity", "0.5"],
          "compute_scale": ["NaN", "Infinity", "-2"], "selective_overhead": ["NaN", "-1"],
          "peak_flops": ['{"fp32": NaN}', '{"fp32": Infinity}', '{"fp32": -1}'],
          "intra_node": ['{"bandwidth": NaN, "latency": 1e-6}', '{"bandwidth": 1e9, "latency": Infinity}',
                         '{"bandwidth": 1e9, "latency": -1}'],
          "groups": ['{"2": {"bandwidth": 1e9, "latency": NaN}}', '{"0": {"bandwidth": 1e9, "latency": 0}}'],
          "efficiency": ['{"matmul": NaN}', '{"matmul": 2}'], "default_dtype": ['"int4"', "3"], "name": ["7"]}


@pytest.mark.parametrize("field, value", [(f, v) for f, values in FIELDS.items() for v in values])
def test_every_field_of_a_profile_is_validated(tmp_path, field, value):
    path = tmp_path / "bad.json"
    text = json.dumps(GOOD | {field: "@"}).replace('"@"', value)
    path.write_text(text)
    with pytest.raises(OptionError, match=rf"hardware profile .*bad.json: .*{field}"):
        load_hardware(path)
