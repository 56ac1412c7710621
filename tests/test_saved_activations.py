"""What a rank keeps for backward, measured on real gloo ranks, against what the plan prices, for the program
changes that keep less with the same values (docs/plan-check-verify.md, "saved for backward"):

- ``regather``: under ``--sp`` the column-parallel linears keep the sp shard of their input and gather it again in
  backward (``rt.linears_regathered``), not the gathered input (``--no-overlap`` keeps it);
- ``regather_fp8``: the same under ``--dtype fp8``, whose column-parallel linears are fp8 products
  (``rt.fp8_linears_regathered``; the output head stays bf16, ``rt.linears_regathered``);
- ``silu_mul``: SwiGLU's ``silu(gate) * up`` keeps gate and up, not ``silu(gate)`` (``rt.silu_mul``);
- ``rms_normalize``: RMSNorm's fp32 part keeps its bf16 input, not the fp32 copy and rsqrt (``rt.rms_normalize``);
- ``gqa``: attention keeps k and v at the kv heads (SDPA's ``enable_gqa``), not repeated to the query heads.

Each change: the bytes autograd saves in one microbatch (``saved_tensors_hooks`` on the rank module, ``fxshard run
--memory-report``'s probe) drop by what the graph says they should, against the same program without that change;
the plan's figure (``fxshard.cost.saved``'s trace) is the measured one; and training still matches one device
(losses within 1e-5 relative over 3 AdamW steps in fp32, the bf16 tolerance in bf16; parameters within verify's
share of the update).  The ops' gradients are bit-identical to the ATen ops' (``tests/runtime/test_activations.py``).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from unittest import mock

import pytest
from harness import assert_matches_single_device, compile_and_train, single_device, spawn

from fxshard.check.verify import default_tolerances
from fxshard.cost.costs import plan_costs
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout, spec
from fxshard.ir.placement import local_shape
from fxshard.runtime import activations as rta
from fxshard.runtime import collectives as rtc
from fxshard.runtime import fp8 as rt_fp8
from fxshard.testing import matrix, measure_on_rank, selected_cases
from fxshard.train.optim import OptimConfig

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "samples" / "llama.py"  # 4 layers, hidden 64, ffn 128, 8 heads, 4 kv heads
SP = Layout(tp=2, sp=True, dtype="bf16")
FP8_SP = Layout(tp=2, sp=True, dtype="fp8")
STEPS = 3


def _base(change: str) -> str:
    """The program a change is measured in: ``all`` (SP), or ``all_fp8`` (FP8_SP) for the fp8 regather."""
    return "all_fp8" if change == "regather_fp8" else "all"


@contextlib.contextmanager
def _without(change: str):
    """The compiler without one of the changes: the program before it."""
    if change in ("regather", "regather_fp8"):
        yield Layout(tp=2, sp=True, dtype="fp8" if change == "regather_fp8" else "bf16", overlap=False)
        return
    from fxshard.passes import saved_activations  # the rewrites' table, patched for the comparison alone

    kept = tuple(r for r in saved_activations.REWRITES if r[0] != change)
    assert len(kept) < len(saved_activations.REWRITES), change
    with mock.patch.object(saved_activations, "REWRITES", kept):
        yield SP


def _local_bytes(node) -> int:
    val = node.meta["val"]
    return math.prod(local_shape(tuple(val.shape), spec(node).placement, SP.tp)) * val.element_size()


def _regather(gm) -> int:  # each fused node's gathered input, less its shard
    return sum(_local_bytes(n.args[0]) // 2 for n in gm.graph.nodes if n.target is rtc.linears_regathered)


def _regather_fp8(gm) -> int:  # the same, of the fp8 linears and of the bf16 head's
    fp8 = sum(_local_bytes(n.args[0]) // 2 for n in gm.graph.nodes if n.target is rt_fp8.fp8_linears_regathered)
    return fp8 + _regather(gm) if fp8 else 0


def _silu_mul(gm) -> int:  # silu(gate): the size of the product
    return sum(_local_bytes(n) for n in gm.graph.nodes if n.target is rta.silu_mul)


def _rms_normalize(gm) -> int:  # x32 and rsqrt's [..., 1], less x kept in bf16
    return sum(_local_bytes(n) + _local_bytes(n) // n.meta["val"].shape[-1] - _local_bytes(n.args[0])
               for n in gm.graph.nodes if n.target is rta.rms_normalize)


def _gqa(gm) -> int:  # k and v at the query heads, less k and v at the kv heads
    return sum(_local_bytes(kv) * (n.args[0].meta["val"].shape[1] // kv.meta["val"].shape[1] - 1)
               for n in gm.graph.nodes if n.kwargs.get("enable_gqa") for kv in n.args[1:3])


CHANGES = {"regather": _regather, "regather_fp8": _regather_fp8, "silu_mul": _silu_mul,
           "rms_normalize": _rms_normalize, "gqa": _gqa}
# make test's (the collective ones, bf16 and fp8, and a bf16 op); make test-matrix runs all
KEEP = ("regather", "regather_fp8", "rms_normalize")


@pytest.fixture(scope="module")
def measured(tmp_path_factory, request):
    """Per variant (all changes, and each selected change left out): the compile, the plan's saved bytes of pp rank 0
    and the measured saved bytes of one microbatch on each rank."""
    compiled, plans = {}, {}
    changes = selected_cases(request, CHANGES, "measured")
    for name in (*sorted({_base(c) for c in changes}), *changes):
        base = {"all": SP, "all_fp8": FP8_SP}.get(name)
        with _without(name) if base is None else contextlib.nullcontext(base) as layout:
            compiled[name] = compile_model(LLAMA, layout, out=tmp_path_factory.mktemp(name))
            plans[name] = plan_costs(LLAMA, layout).ranks[0]["saved"].value
    per_rank = spawn(measure_on_rank, 2, {name: str(r.out) for name, r in compiled.items()}, 2, timeout=600)
    return compiled, plans, per_rank


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", matrix(CHANGES, KEEP))
def test_each_change_keeps_what_the_graph_says_as_measured_and_as_planned(measured, case):
    change, base = case, _base(case)
    compiled, plans, per_rank = measured
    drop = CHANGES[change](compiled[base].gm)
    assert drop > 0 and CHANGES[change](compiled[change].gm) == 0
    assert plans[change] - plans[base] == drop
    for rank, found in enumerate(per_rank):
        assert found[change]["saved"] - found[base]["saved"] == drop, rank
        # the plan's figure is the measured one, but for 8 bytes (a scalar) in every program, not of these changes
        for name in (base, change):
            assert abs(found[name]["saved"] - plans[name]) <= 8, (rank, name, found[name]["saved"], plans[name])


def test_the_rank_file_says_what_runs(samples):
    code = compile_model(LLAMA, SP).sources["rank_pp0_tp0.py"]
    assert "= rt.linears_regathered(gather_to, self.tp, shard=" in code
    assert "silu_mul = rt.silu_mul(linear_4, linear_5)" in code and "aten.silu" not in code
    assert "rms_normalize = rt.rms_normalize(hidden_states, 1e-06)" in code and "aten.rsqrt" not in code
    assert "enable_gqa=True)" in code and "aten.expand" not in code


TRAINED = {"llama-tp2-sp": Layout(tp=2, sp=True),
           "llama-tp2-sp-selective": Layout(tp=2, sp=True, recompute="selective"), "llama-tp2-sp-bf16": SP}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    cases = {c: (LLAMA, TRAINED[c], OptimConfig()) for c in selected_cases(request, TRAINED, "trained")}
    return compile_and_train(cases, tmp_path_factory, STEPS)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", matrix(TRAINED, ("llama-tp2-sp-bf16",)))
def test_the_changed_program_trains_as_one_device(trained, case):
    layout = TRAINED[case]
    want, single = single_device(LLAMA, STEPS, OptimConfig(), dtype=layout.dtype)
    per_rank, manifest = trained[case]
    assert_matches_single_device(case, LLAMA, layout, per_rank, manifest, want, single, default_tolerances(layout)[0])


def test_the_one_device_model_runs_attention_on_the_kv_heads_as_the_rewrite_does():
    """Why SDPA with ``enable_gqa`` is the one-device program: transformers calls it so when no mask is passed (the
    capture passes one, so its graph repeats k and v).  Against the repeated k and v, the output and q's gradient are
    the same bit for bit; k's and v's gradients are summed over a group in another order (inside the kernel, where
    ``expand``'s backward sums per-head ones), so they differ by rounding alone."""
    import torch

    from fxshard.capture.modelfile import load_model_file

    model_file = load_model_file(LLAMA)
    model, batch = model_file.make_model(), model_file.make_inputs()
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((kwargs.get("enable_gqa"), q.shape[1], k.shape[1]))
        return sdpa(q, k, v, *args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy):
        model(**batch)
    assert calls and all(c == (True, 8, 4) for c in calls)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=g, requires_grad=True) for h in (8, 4, 4))
    grad = torch.randn(2, 8, 16, 8, generator=g)

    def repeated(t):
        return t[:, :, None].expand(2, 4, 2, 16, 8).reshape(2, 8, 16, 8)

    ours = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, None, is_causal=True, enable_gqa=True)
    theirs = torch.ops.aten.scaled_dot_product_attention.default(q, repeated(k), repeated(v), None, is_causal=True)
    assert torch.equal(ours, theirs)
    (dq, dk, dv), (dq2, dk2, dv2) = (torch.autograd.grad(o, (q, k, v), grad) for o in (ours, theirs))
    assert torch.equal(dq, dq2)
    torch.testing.assert_close(dk, dk2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dv, dv2, rtol=1e-6, atol=1e-6)
