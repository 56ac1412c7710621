"""``fxshard plan``: symbolic costs against the known formulas on a GPT configuration (samples/gpt.py:
8 layers, hidden H = 64, vocabulary V = 256, example batch 8 x sequence 16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sympy
from cli_in_process import fxshard

from fxshard.cost.alive import alive_counts
from fxshard.cost.costs import B, S, parse_size, plan_costs
from fxshard.errors import LayoutError, OptionError
from fxshard.ir.context import Layout
from fxshard.train.memory import formula

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "samples" / "gpt.py"
L, H, V = 8, 64, 256


@pytest.mark.slow
def test_tensor_parallel_traffic_is_four_all_reduces_of_bsh_per_layer():
    report = plan_costs(GPT, Layout(tp=2))
    (rank,) = report.ranks
    # per layer: forward all-reduce after attention and after the MLP (row-parallel outputs), backward
    # all-reduce of the gradient entering q/k/v and the MLP (column-parallel inputs): 4 x B*S*H.
    # Plus the vocab-parallel embedding's forward all-reduce and the lm_head input's backward all-reduce.
    assert sympy.simplify(rank["tp_allreduce"].expr - (4 * L + 2) * B * S * H) == 0
    # the vocab-parallel cross entropy gathers 2 fp32 numbers per token from each rank; the logits, which
    # samples/gpt.py also returns, are gathered only when the module returns its outputs, not in training
    assert sympy.simplify(rank["tp_allgather"].expr - B * S * 2 * 2) == 0
    assert rank["tp_allreduce"].value == (4 * L + 2) * 8 * 16 * H  # evaluated at the example's B, S


@pytest.mark.slow
def test_pipeline_traffic_is_bsh_per_boundary_and_direction():
    report = plan_costs(GPT, Layout(pp=2, microbatches=4))
    first, last = report.ranks
    # forward: each microbatch's hidden state (B/M*S*H, M times); the targets are not sent: the last stage takes
    # them from its own microbatch of the batch (d86c91a)
    assert sympy.simplify(first["pp_send"].expr - B * S * H) == 0
    assert sympy.simplify(last["pp_send"].expr - B * S * H) == 0  # backward: the hidden state's gradient
    assert first["tp_allreduce"].expr == 0


@pytest.mark.slow
def test_zero_model_state_bytes_follow_the_formulas():
    for dtype in ("fp32", "bf16"):
        for zero in (0, 1, 2, 3):
            report = plan_costs(GPT, Layout(dp=4, zero=zero, dtype=dtype))
            (rank,) = report.ranks
            psi = int(rank["psi"].value)
            total = rank["params"].value + rank["grads"].value + rank["optimizer"].value
            assert total == formula(zero, 4, dtype == "bf16", psi)["total"]
            assert total == {0: 16 * psi, 1: (8 + 8 / 4) * psi if dtype == "fp32" else (4 + 12 / 4) * psi,
                             2: (4 + 12 / 4) * psi if dtype == "fp32" else (2 + 14 / 4) * psi,
                             3: 16 * psi / 4}[zero]
            # held during forward: the compute-dtype parameters; ZeRO 2 gathers the stage whole next to the fp32
            # shard; ZeRO 3 the stage's rest and two of its 8 blocks (49,984 parameters each) (tests/test_memory.py)
            low = 2 if dtype == "bf16" else 4
            gathered = psi - 6 * 49_984 if zero == 3 else psi
            assert rank["params_peak"].value == low * gathered + (4 * psi / 4 if zero >= 2 else 0)


@pytest.mark.slow
def test_bubble_fraction_and_evaluation_at_other_sizes():
    report = plan_costs(GPT, Layout(pp=4, microbatches=8), batch=64, seq=2048)
    assert report.bubble.expr == sympy.Rational(3, 11)  # (p-1)/(m+p-1)
    assert report.at == {B: 64, S: 2048}
    assert report.ranks[3]["pp_send"].value == 64 * 2048 * H
    interleaved = plan_costs(GPT, Layout(pp=2, schedule="interleaved-1f1b", microbatches=4))
    assert interleaved.bubble.expr == sympy.Rational(1, 2 * 4 + 1)  # (p-1)/(v*m+p-1), v = 2


@pytest.mark.slow
def test_forward_values_grow_with_batch_and_sequence():
    (rank,) = plan_costs(GPT, Layout(tp=2)).ranks
    expr = rank["forward_values"].expr
    assert expr.coeff(B * S) > 0  # every hidden state is B x S x (H or 4H or V/tp)
    # nothing stays at the example's size (e.g. the bias add after an all-reduce) except the loss itself, the
    # 0-d values of the graph: the summed token losses and their token mean, two fp32 scalars
    assert expr.subs({B: 0, S: 0}) == 8


@pytest.mark.slow
def test_saved_bytes_are_what_autograd_keeps_not_every_forward_value():
    (rank,) = plan_costs(GPT, Layout()).ranks
    # issue 16: every forward value is 6.85 MiB, the tensors saved for backward measure 4.22 MiB
    assert round(rank["forward_values"].value / 2**20, 2) == 6.85
    assert round(rank["saved"].value / 2**20, 2) == 4.22
    assert rank["saved"].expr.coeff(B * S) > 0 and rank["alive"].value == 1
    assert rank["peak"].value == rank["model_state"].value + rank["activations"].value + rank["transient"].value
    # fitted in B and S: evaluated elsewhere, the expression scales (the causal flash kernel saves no S x S)
    big = plan_costs(GPT, Layout(), batch=16, seq=16).ranks[0]["saved"].value
    assert abs(big / rank["saved"].value - 2) < 0.01


@pytest.mark.parametrize("schedule,pp,m,want", [
    ("gpipe", 2, 4, [4, 4]), ("gpipe", 4, 8, [8] * 4),
    ("1f1b", 2, 4, [2, 1]), ("1f1b", 4, 8, [4, 3, 2, 1]), ("1f1b", 4, 4, [4, 3, 2, 1]),
    # torch's interleaved order at v = 2 (chunks per rank); its peak vectors hold these many in all
    ("interleaved-1f1b", 2, 4, [5, 3]), ("interleaved-1f1b", 4, 8, [11, 9, 7, 5]),
    ("zero-bubble", 2, 4, [2, 2]), ("zero-bubble", 4, 8, [4, 4, 4, 4]),
])
def test_microbatches_alive_come_from_the_schedule_order(schedule, pp, m, want):
    v = 2 if schedule == "interleaved-1f1b" else 1
    counts = alive_counts(schedule, pp, m, v)
    assert [max(sum(c.values()) for c in counts[r]) for r in range(pp)] == want
    if schedule == "1f1b":
        assert want == [min(m, pp - r) for r in range(pp)]  # p - stage, capped by m
    if schedule == "interleaved-1f1b":
        assert all(set(c) == {r, r + pp} for r in range(pp) for c in counts[r])  # the rank's two chunks


@pytest.mark.slow
def test_plan_peak_multiplies_saved_bytes_by_the_alive_microbatches():
    first, last = plan_costs(GPT, Layout(pp=2, microbatches=4)).ranks
    assert first["alive_by_stage"] == {0: 2} and last["alive_by_stage"] == {1: 1}
    assert first["activations"].expr == sympy.expand(2 * first["saved"].expr)
    gpipe = plan_costs(GPT, Layout(pp=2, schedule="gpipe", microbatches=4)).ranks[0]
    assert gpipe["activations"].expr == sympy.expand(4 * gpipe["saved"].expr)


@pytest.mark.slow
def test_device_memory_verdict_and_bad_sizes():
    assert parse_size("80GiB") == 80 * 2**30 and parse_size("80GB") == 80 * 10**9
    assert parse_size("16GiB") == 16 * 2**30 and parse_size("512 MiB") == 512 * 2**20
    for bad in ("80GiBs", "eighty", "-1GiB", "0GB", ""):
        with pytest.raises(OptionError, match="--device-memory"):
            parse_size(bad)
    (rank,) = plan_costs(GPT, Layout(), device_memory=parse_size("16MiB")).ranks
    assert rank["verdict"]["fits"] and rank["verdict"]["headroom"] == 16 * 2**20 - rank["peak"].value
    (rank,) = plan_costs(GPT, Layout(), device_memory=parse_size("4MiB")).ranks
    assert not rank["verdict"]["fits"] and rank["verdict"]["headroom"] < 0


@pytest.mark.slow
def test_plan_command_prints_tables_and_json():
    run = fxshard("plan", GPT, "--tp", 2, "--pp", 2, "--json", cwd=ROOT)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert {"saved", "alive", "activations", "transient", "model_state", "peak"} <= set(data["ranks"][0])
    assert [r["pp_rank"] for r in data["ranks"]] == [0, 1]
    assert data["ranks"][0]["tp_allreduce"]["expr"] and data["bubble"]["expr"] == "1/3"
    table = fxshard("plan", GPT, "--tp", 2, "--device-memory", "4MiB", cwd=ROOT)
    assert "tp all-reduce elements per step" in table.stdout and "B*S" in table.stdout
    assert "predicted peak bytes" in table.stdout and "does not fit a 4.00 MiB device" in table.stdout
    bad = fxshard("plan", GPT, "--device-memory", "80 GiBs", cwd=ROOT)
    assert bad.returncode == 2 and "--device-memory '80 GiBs': expected a positive size" in bad.stderr


@pytest.mark.slow
def test_zero3_under_a_pipeline_counts_a_gather_per_microbatch_forward():
    # FSDP2 reshards after each microbatch's forward and keeps the parameters for all the backwards:
    # m + 1 all-gathers and one reduce-scatter of the stage's parameters per step (measured in
    # benchmarks/comm_axes.py; without a pipeline, m = 1 and this is ZeRO 3's 3 passes)
    for m in (2, 4):
        first = plan_costs(GPT, Layout(dp=2, pp=2, zero=3, microbatches=m)).ranks[0]
        psi = int(first["psi"].value)
        assert first["dp_bytes"].value == (m + 2) * (2 - 1) / 2 * 4 * psi
    (alone,) = plan_costs(GPT, Layout(dp=2, zero=3)).ranks
    assert alone["dp_bytes"].value == 3 * (2 - 1) / 2 * 4 * int(alone["psi"].value)


@pytest.fixture(scope="module")
def gpt_by_recompute():
    return plan_costs(GPT, Layout(tp=2))


@pytest.mark.slow
def test_each_recompute_mode_has_its_peak(gpt_by_recompute):
    """Full keeps less than selective, which keeps less than none; the rows are the asked mode's."""
    row = gpt_by_recompute.ranks[0]
    peaks = {m: c.value for m, c in row["recompute_peaks"].items()}
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    assert row["peak"].value == peaks["none"]
    full = plan_costs(GPT, Layout(tp=2, recompute="full"))
    assert full.ranks[0]["peak"].value == peaks["full"] and full.recompute == "full"
    assert full.ranks[0]["saved"].value < row["saved"].value
    flops = row["recompute_flops"]
    assert flops["none"] == 0 and 0.25 < flops["full"] <= 1 / 3, flops  # one forward of the blocks per step
    summary = json.loads(json.dumps(gpt_by_recompute.to_json()))["recompute"]
    assert summary["mode"] == "none" and not summary["auto"] and set(summary["peaks"]) == {"none", "selective", "full"}


@pytest.mark.slow
def test_auto_picks_the_least_recompute_that_fits(gpt_by_recompute):
    peaks = {m: c.value for m, c in gpt_by_recompute.ranks[0]["recompute_peaks"].items()}
    for device, want in ((peaks["none"] + 1, "none"), (peaks["none"] - 1, "selective"),
                         (peaks["selective"] - 1, "full")):
        report = plan_costs(GPT, Layout(tp=2, recompute="auto"), device_memory=int(device))
        assert (report.recompute, report.recompute_auto, report.layout.recompute) == (want, True, want)
        assert report.ranks[0]["peak"].value == peaks[want] and report.ranks[0]["verdict"]["fits"]


@pytest.mark.slow  # a search over every layout: 4.4 s alone
def test_auto_refuses_a_device_nothing_fits_and_a_missing_size():
    from fxshard.errors import LayoutError

    with pytest.raises(LayoutError, match=r"pp rank 0 .* even under --recompute full; .*1\.00 MiB|1\.00 MiB.*"
                                          r"pp rank 0 .* even under --recompute full"):
        plan_costs(GPT, Layout(recompute="auto"), device_memory=2**20)
    with pytest.raises(OptionError, match="expected --device-memory"):
        plan_costs(GPT, Layout(recompute="auto"))


@pytest.mark.slow
def test_compile_auto_writes_the_chosen_mode():
    from fxshard.driver import compile as compile_model

    full = plan_costs(GPT, Layout(tp=2, recompute="full")).ranks[0]["peak"].value
    result = compile_model(GPT, Layout(tp=2, recompute="auto"), device_memory=int(full) + 1)
    assert result.ctx.layout.recompute == "full" and result.memory_plan.recompute_auto
    assert "rt.recompute(self.blocks_0" in result.sources["rank_pp0_tp0.py"]
    assert "recompute=full" in result.sources["rank_pp0_tp0.py"]


@pytest.fixture(scope="module")
def gpt_pp2_peaks():
    """samples/gpt.py at pp=2 (batch 8: the default is 2 microbatches of 4): the worst rank's peak per count."""
    return {m: plan_costs(GPT, Layout(pp=2, microbatches=m)) for m in (2, 4)}


def _worst(report) -> float:
    return max(r["peak"].value for r in report.ranks)


# the microbatch search over a pp2 plan at 2 and 4 (minutes of captures); make test keeps
# test_plan_peak_multiplies_saved_bytes_by_the_alive_microbatches
@pytest.mark.matrix
@pytest.mark.slow
def test_device_memory_raises_the_default_microbatches_to_the_fewest_that_fit(gpt_pp2_peaks):
    """Where the default count (2) does not fit --device-memory and 4 does, the plan is the plan at 4, figure for
    figure, and says what it chose and why; given explicitly, --microbatches 2 stays 2 and does not fit."""
    device = int(_worst(gpt_pp2_peaks[4])) + 1
    assert _worst(gpt_pp2_peaks[2]) > device
    chosen = plan_costs(GPT, Layout(pp=2), device_memory=device)
    assert chosen.layout.microbatches == 4 and chosen.fits
    assert chosen.microbatch_choice == {"default": 2, "chosen": 4, "fits": True, "batch_per_dp": 8,
                                        "schedule": "1f1b", "pp": 2, "device_memory": device,
                                        "tried": {2: _worst(gpt_pp2_peaks[2]), 4: _worst(gpt_pp2_peaks[4])}}
    for row, explicit in zip(chosen.ranks, gpt_pp2_peaks[4].ranks, strict=True):
        for key in ("peak", "saved", "alive", "activations", "pp_send", "model_state"):
            assert row[key].expr == explicit[key].expr, key
    assert chosen.bubble.expr == gpt_pp2_peaks[4].bubble.expr == sympy.Rational(1, 5)
    fixed = plan_costs(GPT, Layout(pp=2, microbatches=2), device_memory=device)
    assert fixed.layout.microbatches == 2 and not fixed.fits and fixed.microbatch_choice is None
    roomy = plan_costs(GPT, Layout(pp=2), device_memory=10 * 2**20)  # the default fits: kept, and said
    assert roomy.layout.microbatches == 2 and roomy.microbatch_choice["tried"] == {2: _worst(gpt_pp2_peaks[2])}


@pytest.mark.matrix  # the same search through the CLI; make test keeps test_plan_command_prints_tables_and_json
@pytest.mark.slow
def test_plan_and_compile_print_and_use_the_same_chosen_microbatches(gpt_pp2_peaks, tmp_path):
    device = str(int(_worst(gpt_pp2_peaks[4])) + 1)
    plan = fxshard("plan", GPT, "--pp", 2, "--device-memory", device, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    line = next(ln for ln in plan.stdout.splitlines() if ln.startswith("microbatches:"))
    assert line.startswith("microbatches: 4 of 2 row(s) per dp rank (chosen for --device-memory") and \
        "the default 2, the fewest 1f1b runs at pp=2" in line and "does not fit every rank" in line, line
    assert "does not fit" not in plan.stdout.replace(line, "")  # every rank's verdict fits
    compiled = fxshard("compile", GPT, "--pp", 2, "--device-memory", device, "--meta", "--out", tmp_path / "out",
                       cwd=ROOT)
    assert compiled.returncode == 0, compiled.stderr
    assert line in compiled.stdout and "microbatches=4" in compiled.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["layout"]["microbatches"] == manifest["pipeline"]["microbatches"] == 4
    explicit = fxshard("plan", GPT, "--pp", 2, "--microbatches", 2, "--device-memory", device, cwd=ROOT)
    assert "microbatches:" not in explicit.stdout and "microbatches=2" in explicit.stdout
    assert "does not fit" in explicit.stdout


@pytest.mark.matrix  # make test keeps test_auto_picks_the_least_recompute_that_fits
@pytest.mark.slow
def test_recompute_auto_raises_microbatches_only_where_no_mode_fits_and_refuses_when_none_does(gpt_pp2_peaks):
    full = {m: max(r["recompute_peaks"]["full"].value for r in gpt_pp2_peaks[m].ranks) for m in (2, 4)}
    at_default = plan_costs(GPT, Layout(pp=2, recompute="auto"), device_memory=int(full[2]) + 1)
    assert (at_default.layout.microbatches, at_default.recompute) == (2, "full")  # fits at the default: kept
    raised = plan_costs(GPT, Layout(pp=2, recompute="auto"), device_memory=int(full[4]) + 1)
    assert (raised.layout.microbatches, raised.recompute, raised.fits) == (4, "full", True)
    with pytest.raises(LayoutError, match=r"even under --recompute full at the default 2 microbatches, and no other "
                                          r"count that divides the batch of 8 per dp rank fits .*2: .*8: "):
        plan_costs(GPT, Layout(pp=2, recompute="auto"), device_memory=2**20)


@pytest.mark.matrix  # the target, a 70B shape at 128k tokens: several minutes of captures
def test_the_70b_long_context_target_fits_at_one_sequence_per_microbatch():
    run = fxshard("plan", "samples/llama70b.py", "--tp", 8, "--cp", 4, "--pp", 2, "--dp", 1, "--zero", 1, "--dtype",
                  "bf16", "--seq", 131072, "--device-memory", "80GiB", "--recompute", "auto", cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "microbatches: 64 of 1 row(s) per dp rank (chosen for --device-memory 80.00 GiB" in run.stdout
    assert run.stdout.count("fits a 80.00 GiB device") == 2 and "does not fit a" not in run.stdout
    assert "recompute: full (chosen by --recompute auto" in run.stdout and "30720*B*S" in run.stdout


QWEN_MOE = ROOT / "tests" / "models" / "hf_qwen3_moe.py"  # 2 MoE layers, hidden 32, 4 experts of 16, top-2
MOE_L, MOE_H, MOE_E, MOE_I, MOE_K = 2, 32, 4, 16, 2


@pytest.mark.slow
def test_a_meta_compile_of_a_moe_model_writes_what_a_real_compile_writes():
    # transformers' grouped-matmul experts histogram the expert ids as floats on cpu and as int32 elsewhere (CPU
    # kernels refuse int32); captured on meta, fxshard plan (which compiles on meta) took the int32 branch and
    # failed on every MoE model: "histogram_cpu" not implemented for 'torch.int32'.  Now meta tensors are traced
    # as fake CPU tensors, and the rank files are the same, byte for byte.
    from fxshard.driver import compile as compile_model

    for layout in (Layout(tp=2), Layout(dp=2, ep=2)):
        real = compile_model(QWEN_MOE, layout).sources
        meta = compile_model(QWEN_MOE, layout, meta=True).sources
        assert meta == real, layout
        assert "aten.histc.default(to_9, 4, 0, 3)" in real["rank_pp0_tp0.py"]


@pytest.mark.matrix  # make test keeps tests/test_moe_tensor_parallel.py's test_plan_counts_the_experts_split
@pytest.mark.slow
def test_plan_of_a_moe_model_without_and_with_ep():
    (tp,) = plan_costs(QWEN_MOE, Layout(tp=2)).ranks
    assert tp["tp_allreduce"].value > 0 and "ep_alltoall" not in tp
    experts = MOE_L * MOE_E * 3 * MOE_H * MOE_I  # gate_up [E, 2I, H] and down [E, H, I] per layer
    for dp, ep, zero in ((2, 2, 0), (4, 2, 1), (4, 2, 3)):
        report = plan_costs(QWEN_MOE, Layout(dp=dp, ep=ep, zero=zero))
        (rank,) = report.ranks
        ring = sympy.Rational(ep - 1, ep)
        # bytes per token x top-k x (N-1)/N: every routed row (H fp32) goes out and comes back, forward and
        # backward; the counts (E int32 per layer) forward only
        rows = B / dp * S * MOE_K
        want = MOE_L * (4 * rows * MOE_H * 4 + MOE_E * 4) * ring
        assert sympy.simplify(rank["ep_alltoall"].expr - want) == 0, rank["ep_alltoall"].expr
        mine = experts // ep
        assert rank["ep_psi"].value == mine
        dense = rank["psi"].value - mine
        # experts: data-parallel over edp = dp/ep; ZeRO 1 shards their Adam state over edp, ZeRO 2/3 leave them whole
        edp = dp // ep
        assert rank["ep_state"].value == mine * (4 + 4 + (8 / edp if zero == 1 else 8))
        assert rank["optimizer"].value == dense * 8 / (dp if zero else 1) + mine * (8 / edp if zero == 1 else 8)
        assert rank["grads"].value == dense * 4 / (dp if zero >= 2 else 1) + mine * 4
        # dp traffic: the dense gradients over dp, the experts' over edp (none when edp = 1); ZeRO 1's distributed
        # optimizer reduce-scatters the gradients and all-gathers the parameters: 2 (N-1)/N, as DDP's all-reduce
        expert_ring = 2 * (edp - 1) / edp * 4 * mine
        dense_ring = {0: 2, 1: 2, 3: 3}[zero] * (dp - 1) / dp * 4 * dense
        assert rank["dp_bytes"].value == pytest.approx(dense_ring + expert_ring)
        if dp == 2:  # the largest value is this rank's gate_up [E/ep, 2I, H], twice: a number, though E/ep = 2 rows
            # of the microbatch here and E = 4 twice that at the plan's second capture size (it read 4096*B)
            assert rank["transient"].expr == 2 * 4 * (MOE_E // ep) * 2 * MOE_I * MOE_H
        assert any("balanced (expected) volume" in n for n in report.notes)


@pytest.mark.slow
def test_plan_of_a_model_whose_python_reads_tensor_values():
    # `if flags.any().item():`, a loop over `hit.nonzero()`: the meta compile cannot specialize them (no values),
    # so the plan compiles on the model's weights; the cost trace runs item() and nonzero() on fake tensors, a
    # size the data decides counted at its largest. It failed with "compile without --meta", then on item()
    report = plan_costs(ROOT / "tests" / "models" / "read_values.py", Layout(tp=2))
    (rank,) = report.ranks
    for cost in ("peak", "saved", "tp_allreduce"):
        assert rank[cost].expr.free_symbols == {B, S} and rank[cost].value > 0, (cost, rank[cost].expr)
        assert rank[cost].value == float(rank[cost].expr.subs({B: 2, S: 4}))  # the example batch: 2 rows of 4
