"""Bytes of model state each rank holds under every ZeRO stage and precision, against the ZeRO formulas.

Every (precision, stage) of samples/gpt.py at dp=2 is compiled and trained for one step on real gloo
processes; ``fxshard.train.launch.train(memory=...)`` walks the tensors each rank actually holds.  Each
category must equal the formula up to the replicated remainder: Adam's per-tensor step counters,
FSDP2's shard padding, and at ZeRO 1 the imbalance of assigning whole tensors to ranks.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from harness import spawn

from fxshard.capture.modelfile import load_model_file
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import matrix, measure_on_rank, selected_cases
from fxshard.train.memory import (
    FSDP2_ZERO2_EXTRA,
    formula,
    formula_text,
    peak_params,
    report_rows,
)
from fxshard.train.reference import reference_losses

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "samples" / "gpt.py"
CASES = [(dtype, zero) for dtype in ("fp32", "bf16") for zero in (0, 1, 2, 3)]


def test_formulas_are_the_zero_papers():
    psi, n = 1000, 4
    assert formula(0, n, False, psi)["total"] == 16 * psi
    assert formula(1, n, False, psi)["total"] == 8 * psi + 8 * psi / n
    assert formula(2, n, False, psi)["total"] == 4 * psi + 12 * psi / n
    assert formula(3, n, False, psi)["total"] == 16 * psi / n
    assert formula(0, n, True, psi)["total"] == 16 * psi
    assert formula(1, n, True, psi)["total"] == 4 * psi + 12 * psi / n
    assert formula(2, n, True, psi)["total"] == 2 * psi + 14 * psi / n
    assert formula(3, n, True, psi)["total"] == 16 * psi / n
    assert formula_text(2, n, True) == "2Ψ + 14Ψ/N"
    assert formula(3, 1, True, psi)["total"] == 16 * psi  # dp=1: nothing to shard over


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    outs, layouts, params = {}, {}, None
    for dtype, zero in CASES:
        name = f"{dtype}-zero{zero}"
        layouts[name] = Layout(dp=2, zero=zero, dtype=dtype)
        result = compile_model(GPT, layouts[name], out=tmp_path_factory.mktemp(name))
        outs[name] = str(result.out)
        params = {k: t for k, t in result.manifest.ranks[0].tensors.items() if t.kind == "parameter"}
    per_rank = spawn(measure_on_rank, 2, outs, timeout=600)
    return {name: report_rows([r[name] for r in per_rank], layouts[name]) for name in outs}, params


@pytest.mark.distributed
@pytest.mark.parametrize("dtype,zero", CASES)
def test_measured_bytes_match_the_zero_formula(measured, dtype, zero):
    rows, by_key = measured
    params = list(by_key.values())
    n_tensors = len(params)
    largest = max(t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1) for t in params)
    mixed = dtype == "bf16"
    for row in rows[f"{dtype}-zero{zero}"]:
        psi, want = row["psi"], dict(row["formula"])
        assert psi == sum(t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1) for t in params)
        # Adam's step counter (one float per tensor); at ZeRO 1 whole tensors go to one rank
        slack = 8 * n_tensors + ((4 if mixed else 0) + 8) * largest * (zero == 1)
        if zero == 2:  # FSDP2 holds the fp32 shard next to the gathered parameters (fp32) / fp32 grad shards (bf16)
            want["total"] += FSDP2_ZERO2_EXTRA[mixed] * psi / 2
            if not mixed:
                want["params"] += FSDP2_ZERO2_EXTRA[mixed] * psi / 2
        assert abs(row["total"] - want["total"]) <= slack, (
            f"{dtype} zero {zero} rank {row['rank']}: measured {row['total']} bytes, formula {want['total']:.0f}")
        # per category too, except where FSDP2's fp32 shards are both the parameters and the master weights
        if not (mixed and zero >= 2):
            for key in ("params", "grads", "optimizer"):
                assert abs(row[key] - want[key]) <= (slack if key == "optimizer" else 0), (
                    f"{dtype} zero {zero} rank {row['rank']} {key}: measured {row[key]} bytes, "
                    f"formula {want[key]:.0f}")
        # nothing else holds model state: all live tensor storage (after the step, before zero_grad) is the
        # three categories plus buffers and the batches, well under a tenth of the baseline here
        assert row["live"] - row["total"] <= 1.6 * psi, (
            f"{dtype} zero {zero} rank {row['rank']}: {row['live'] - row['total']} bytes alive outside the "
            "parameters, gradients and optimizer state")
        # what `fxshard plan` states as held during forward: under ZeRO 0/1 the compute-dtype parameters; under
        # ZeRO 2 the whole module gathered next to its shard; under ZeRO 3 the module's rest and the running
        # block (each block its own FSDP2 unit), plus the next block, whose prefetched all-gather buffer the
        # probe (at each unit's forward) does not see
        blocks = _block_params(by_key)
        plan = peak_params(zero, 2, mixed, psi, blocks)
        unseen = (2 if mixed else 4) * sorted(blocks)[-2] if zero == 3 else 0
        assert row["gathered"] == plan - unseen, (row["gathered"], plan, unseen)
        if zero == 3:  # gathered at once: the module's rest and two of its eight blocks, not the whole module
            shard = 4 * psi / 2
            assert plan - shard < (peak_params(zero, 2, mixed, psi) - shard) / 3


def _block_params(params) -> list[int]:
    """Parameters per block submodule (manifest keys ``blocks_3.attn_q_proj_weight``)."""
    per: dict[str, int] = {}
    for key, t in params.items():
        if "." in key:
            per[key.split(".")[0]] = (per.get(key.split(".")[0], 0)
                                      + t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1))
    return list(per.values())


def test_bf16_training_follows_fp32_and_is_not_fp32():
    mf = load_model_file(GPT)
    fp32 = reference_losses(mf, 3)
    bf16 = reference_losses(mf, 3, dtype="bf16")
    assert fp32 != bf16
    for a, b in zip(fp32, bf16, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a)


LLAMA = ROOT / "samples" / "llama.py"
SAVED_LAYOUTS = {"tp1": Layout(), "tp2": Layout(tp=2), "pp2": Layout(pp=2), "tp2-sp": Layout(tp=2, sp=True),
                 "tp2-sp-selective": Layout(tp=2, sp=True, recompute="selective"),
                 **{f"tp{t}-{mode}": Layout(tp=t, recompute=mode) for t in (1, 2) for mode in ("selective", "full")}}
SAVED_CASES = {f"{m}-{lay}": (m, lay) for m, lays in (("gpt", SAVED_LAYOUTS), ("llama", SAVED_LAYOUTS))
               for lay in lays if not (m == "llama" and lay.startswith("tp2-sp"))}
# make test's representatives (each recompute mode, tp, pp, sp); make test-matrix runs every case
SAVED_KEEP = ("llama-tp1-full", "llama-tp2-selective", "llama-pp2", "gpt-tp2-sp")


@pytest.fixture(scope="module")
def saved_measured(tmp_path_factory, request):
    """Train the selected (model, layout) cases for 2 steps on real gloo processes; the last step measures, per
    rank, the bytes autograd saved in one microbatch's forward and the step's peak (fxshard run --memory-report's
    probe)."""
    found, worlds = {}, {}
    for case in selected_cases(request, SAVED_CASES, "saved_measured"):
        m, lay = SAVED_CASES[case]
        worlds.setdefault(SAVED_LAYOUTS[lay].world_size, {})[case] = str(compile_model(
            {"gpt": GPT, "llama": LLAMA}[m], SAVED_LAYOUTS[lay], out=tmp_path_factory.mktemp(case)).out)
    for world, outs in worlds.items():
        for rank, per_case in enumerate(spawn(measure_on_rank, world, outs, 2, timeout=600)):
            for name, sample in per_case.items():
                found.setdefault(name, {})[rank] = sample
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(SAVED_CASES, SAVED_KEEP))
def test_measured_saved_bytes_match_the_plan(saved_measured, case):
    from fxshard.cost.costs import plan_costs

    model, layout = SAVED_CASES[case]
    lay = SAVED_LAYOUTS[layout]
    report = plan_costs({"gpt": GPT, "llama": LLAMA}[model], lay)
    for rank, sample in saved_measured[f"{model}-{layout}"].items():
        row = report.ranks[lay.coords(rank).pp]
        ratio = sample["saved"] / row["saved"].value
        print(f"{model} {layout} rank {rank}: saved measured/plan {ratio:.3f}, peak "
              f"{sample['peak'] / row['peak'].value:.3f}")
        assert 0.9 <= ratio <= 1.1, f"{model} {layout} rank {rank}: measured {sample['saved']} saved bytes, plan " \
                                    f"{row['saved'].value:.0f}"
        # the peak is an estimate (transient: twice the largest forward value, plus under recompute the block
        # whose forward backward runs again): every case read 0.83-1.07 of the plan in two runs of all 26, the
        # ranks of one case within 0.03 of each other (gloo's threads free buffers at their own pace)
        assert 0.75 <= sample["peak"] / row["peak"].value <= 1.25, (model, layout, rank, sample["peak"],
                                                                    row["peak"].value)


def test_cpu_peak_counts_only_the_measured_block():
    """The CPU peak is what the block allocates on top of what is alive at its start, whatever earlier profiles
    in the process allocated: the profiler's own running total carries those (here 4 MB freed while no profile
    ran), and a spawn that measured several cases read up to 1.6 times the plan for its last case."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fxshard.train.memory import MemoryProbe, storage_bytes

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        left = torch.zeros(1_000_000)
    del left  # freed while no profile runs: the allocator's total still counts it
    probe = MemoryProbe([torch.nn.Linear(4, 4)])
    kept = torch.ones(250_000)  # alive at the start: in the baseline
    gc.collect()
    base = storage_bytes(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    with probe.measured_step(torch.device("cpu")):
        a = torch.zeros(500_000)  # 2 MB
        b = torch.zeros(250_000)  # 1 MB: 3 MB at once
        del a, b
        c = torch.zeros(600_000)  # 2.4 MB alone afterwards
        del c
    assert probe.sample["peak"] - base == 3_000_000, (probe.sample["peak"], base)
    assert kept.numel() == 250_000
