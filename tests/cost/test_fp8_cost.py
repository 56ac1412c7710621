"""The time model at ``--dtype fp8``: the linears' products move to the fp8 class at the fp8 peak, with the same
FLOPs; their casts are memory traffic; under tp their amaxes are a few float32 values; the head stays bf16."""

from __future__ import annotations

import dataclasses

import pytest
import sympy

from fxshard.cost.hardware import load_hardware
from fxshard.cost.profile import S, T, b, model_profile
from fxshard.cost.timemodel import Evaluator

MODEL = "samples/llama.py"  # 4 layers, hidden 64, 8 heads (4 kv), vocabulary 256
AT = {b: 2, S: 16, T: 2}


@pytest.fixture(scope="module")
def profiles():
    return {dtype: model_profile(MODEL, dtype=dtype) for dtype in ("bf16", "fp8")}


def _flops(piece) -> dict:
    return {c: float(sympy.sympify(f).subs(AT)) for c, f in piece.flops.items()}


@pytest.mark.slow
def test_the_linears_move_to_the_fp8_class_with_the_same_flops(profiles):
    for structure in ("tp1", "tp"):
        for name, piece in profiles["bf16"].pieces(structure).items():
            fp8 = _flops(profiles["fp8"].pieces(structure)[name])
            assert sum(fp8.values()) == pytest.approx(sum(_flops(piece).values())), (structure, name)
    block = _flops(profiles["fp8"].pieces("tp1")["block0"])
    assert block["fp8"] > 0 and block.get("matmul", 0) == 0  # every linear of a block: q, k, v, o, gate, up, down
    assert _flops(profiles["fp8"].pieces("tp1")["after"])["matmul"] > 0  # the head: bf16 (torchtitan's filter)
    fp8, bf16 = (profiles[d].pieces("tp1")["block0"] for d in ("fp8", "bf16"))
    assert float(fp8.traffic.subs(AT)) == float(bf16.traffic.subs(AT)) and bf16.casts == bf16.casts_bwd == 0
    # casts, (2·2 + 1) bytes an element of bf16 (--dtype fp8): forward the inputs and weights; backward those again
    # and each output gradient twice.  Seven linears of hidden 64 (q 64, k and v 32, o 64; gate and up 128, down 64 out)
    outputs = 64 + 32 + 32 + 64 + 128 + 128 + 64  # features out of q, k, v, o, gate, up, down
    tokens, weights = 2 * 16, 64 * (outputs - 64) + 128 * 64
    inputs = tokens * (6 * 64 + 128) + weights
    assert float(fp8.casts.subs(AT)) == 5 * inputs
    assert float(fp8.casts_bwd.subs(AT)) == 5 * (inputs + 2 * tokens * outputs)


@pytest.mark.slow
def test_the_fp8_products_run_at_the_fp8_peak(profiles):
    hw = dataclasses.replace(load_hardware("h100"), memory_bandwidth=1e30, kernel_overhead=0.0)  # compute alone
    costs = {d: Evaluator(p, hw).piece("tp1", "block0", 2, 16, 1, 1, 1) for d, p in profiles.items()}
    linears = {d: c.fwd - c.attention for d, c in costs.items()}
    assert linears["fp8"] == pytest.approx(linears["bf16"] * hw.peak_flops["bf16"] / hw.peak_flops["fp8"])
    assert Evaluator(profiles["fp8"], hw).peak == hw.peak_flops["bf16"]  # the rest, and MFU, against bf16's


@pytest.mark.slow
def test_under_tp_the_amaxes_are_a_few_float32_values(profiles):
    comms = profiles["fp8"].pieces("tp")["block0"].comms
    small = [c for c in comms if not sympy.sympify(c.nbytes).free_symbols]
    # tensorwise: per linear tp splits, the input's and the weight's amax forward, the gradient's backward
    assert sorted(float(c.nbytes) for c in small) == [4.0] * 7 + [8.0] * 7
    assert len(comms) - len(small) == len(profiles["bf16"].pieces("tp")["block0"].comms)


def test_a_profile_without_an_fp8_peak_runs_its_products_at_bf16s():
    cpu, h100 = load_hardware("cpu-gloo"), load_hardware("h100")
    assert "fp8" not in cpu.peak_flops and cpu.fp8_peak() == cpu.peak("bf16")
    assert h100.fp8_peak() == 1979e12 and h100.peak("fp8") == h100.peak("bf16")


@pytest.mark.slow
def test_under_sp_an_fp8_layer_keeps_what_a_bf16_layer_keeps(profiles):
    """The q/k/v and gate/up fp8 linears read a gather_to under --sp: fused (``rt.fp8_linears_regathered``) they keep
    its shard, as the bf16 linears do, so the fp8 rows of the recipes page are priced with the program fp8 runs.
    Their amaxes: one all-reduce for q/k/v (the input's and three weights', 16 bytes) and one for gate/up (12)."""
    fp8, bf16 = (profiles[d].pieces("sp")["block0"] for d in ("fp8", "bf16"))
    for mode, kept in bf16.saved.items():
        assert sympy.simplify(fp8.saved[mode] - kept) == 0, mode
    amaxes = [c for c in fp8.comms if c not in bf16.comms]  # the norms' replicated weights: 128 bytes, both
    # forward: q/k/v 16, gate/up 12, o and down 8 each; backward: q/k/v 12, gate/up 8, o and down 4 each
    assert sorted(float(c.nbytes) for c in amaxes) == [4.0, 4.0, 8.0, 8.0, 8.0, 12.0, 12.0, 16.0]
    assert all(c.op == "all_reduce" for c in amaxes)


@pytest.mark.slow
def test_an_fp8_search_proposes_fp8_layouts_with_cp(profiles):
    """``plan --auto --dtype fp8``: the layouts are --dtype fp8 ones, so the command it prints compiles fp8 (it
    printed --dtype bf16); they hold --cp too, whose amaxes go over cp x tp (llama3.1-405b's published recipe is fp8
    at cp2)."""
    from fxshard.cost.auto import compile_command
    from fxshard.cost.search import layouts, search
    from fxshard.cost.timemodel import Setting

    h100 = load_hardware("h100")
    best = search(profiles["fp8"], h100, 8, Setting(32, 16, 8), "fp8", top=1).ranked[0]
    assert best.layout.fp8_recipe == "tensorwise" and "--dtype fp8" in compile_command(MODEL, best)
    every = list(layouts(profiles["fp8"], 8, Setting(32, 16, 8), "fp8"))
    assert every and all(c.layout.fp8_recipe == "tensorwise" for c in every)
    assert any(c.layout.cp > 1 and c.layout.tp > 1 for c in every)


@pytest.mark.slow
def test_under_cp_each_fp8_linear_all_reduces_its_amaxes_over_cp(profiles):
    """At tp=1 the profile's fp8 linears communicate nothing; under --cp each all-reduces its input's and weight's
    amax forward (8 bytes) and its gradient's backward (4) over cp, which the time model adds to the layer (with
    tp's exposed communication: blocking, and nothing to overlap)."""
    hw = load_hardware("h100")
    ev = Evaluator(profiles["fp8"], hw)
    alone, cp = (ev.piece("tp1", "block0", 2, 16, 1, c, 1, 1) for c in (1, 2))
    assert alone.tp_fwd == alone.tp_bwd == 0
    assert cp.tp_fwd == pytest.approx(7 * hw.collective_seconds("all_reduce", 8, 2, 1))
    assert cp.tp_bwd == pytest.approx(7 * hw.collective_seconds("all_reduce", 4, 2, 1))
