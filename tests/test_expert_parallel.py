"""Expert parallelism (``--ep``) trains as one device does, with each rank holding 1/ep of the experts.

Mixtral-, Qwen3-MoE- and DeepSeek-V3-shaped tiny models are compiled at dp=2 ep=2, dp=4 ep=2 and dp=4 ep=4, ZeRO 0 to 3, and
with pp=2 (1f1b and gpipe), and
trained for 3 AdamW steps on real gloo process groups through ``fxshard.train.launch.train`` (what ``fxshard run``
runs on each rank), one spawn per world size.  Losses must match single-device training within 1e-5 relative
and the trained parameters within ``fxshard verify``'s tolerance, as in ``tests/test_training_layouts.py``.
``hf_moe_sparse.py`` routes 8 (token, expert) pairs per rank to 16 experts: on every rank at least half the
experts get no token.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.codegen.manifest import read_manifest
from fxshard.compiler import compile as compile_model
from fxshard.errors import LayoutError
from fxshard.ir.context import Layout
from fxshard.testing import CaseFailure, case_result, spawn_cases
from fxshard.tools.verify import DEFAULT_PARAM_RTOL, compare_parameters, gather_parameters, update_share
from fxshard.train.optim import OptimConfig
from fxshard.train.reference import reference_losses

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"
STEPS = 3
REL = 1e-5
QWEN, MIXTRAL, SPARSE = MODELS / "hf_qwen3_moe.py", MODELS / "hf_mixtral.py", MODELS / "hf_moe_sparse.py"
CLIP = OptimConfig(clip_grad_norm=0.05)
CASES = {
    "qwen3moe-dp2-ep2-zero0": (QWEN, Layout(dp=2, ep=2)),
    "qwen3moe-dp4-ep2-zero1": (QWEN, Layout(dp=4, ep=2, zero=1)),
    "qwen3moe-dp4-ep4-zero0": (QWEN, Layout(dp=4, ep=4)),
    "mixtral-dp2-ep2-zero1": (MIXTRAL, Layout(dp=2, ep=2, zero=1)),
    "mixtral-dp4-ep2-zero0": (MIXTRAL, Layout(dp=4, ep=2)),
    "mixtral-dp4-ep4-zero1": (MIXTRAL, Layout(dp=4, ep=4, zero=1)),
    "sparse-dp4-ep4-zero0": (SPARSE, Layout(dp=4, ep=4)),
    "sparse-dp4-ep2-zero1": (SPARSE, Layout(dp=4, ep=2, zero=1)),
    # ZeRO 2/3: FSDP2 shards the dense parameters over dp; the experts stay whole on each ep rank (1/ep each)
    "qwen3moe-dp4-ep2-zero3": (QWEN, Layout(dp=4, ep=2, zero=3)),
    "mixtral-dp2-ep2-zero3": (MIXTRAL, Layout(dp=2, ep=2, zero=3)),
    "sparse-dp4-ep4-zero2": (SPARSE, Layout(dp=4, ep=4, zero=2)),
    # global-norm clipping: each expert gradient counted once per edp group, not once per dp rank
    "qwen3moe-dp4-ep2-zero1-clip": (QWEN, Layout(dp=4, ep=2, zero=1), CLIP),
    "mixtral-dp4-ep2-zero3-clip": (MIXTRAL, Layout(dp=4, ep=2, zero=3), CLIP),
    # DeepSeek-V3: sigmoid scores with a bias for the top-k choice, shared experts beside the routed ones (a dense MLP,
    # data-parallel), a first dense layer
    "deepseek-v3-dp2-ep2-zero1": (ROOT / "zoo" / "models" / "deepseek_v3.py", Layout(dp=2, ep=2, zero=1)),
    # with pipeline parallelism: an ep group is the dp ranks of one stage, exchanging per microbatch
    "mixtral-dp2-pp2-ep2-zero1": (MIXTRAL, Layout(dp=2, pp=2, ep=2, zero=1)),
    "qwen3moe-dp2-pp2-ep2-zero2-gpipe": (QWEN, Layout(dp=2, pp=2, ep=2, zero=2, schedule="gpipe")),
}


def _case(case: str) -> tuple[Path, Layout, OptimConfig]:
    path, layout, *optim = CASES[case]
    return path, layout, optim[0] if optim else OptimConfig()


def _train_one(out: str, optim: OptimConfig):
    from fxshard.train.launch import train

    state: dict = {}
    memory: dict = {}
    losses = train(Path(out), STEPS, optim, log=lambda *_: None, final_state=state, memory=memory)
    return losses, state, memory


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folders: dict[int, list[tuple[str, Path]]] = {}
    results: dict = {}
    for case in CASES:
        path, layout, optim = _case(case)
        out = tmp_path_factory.mktemp(case)
        try:
            compile_model(path, layout, out=out)
        except Exception as e:
            results[case] = CaseFailure(f"compile failed: {type(e).__name__}: {e}")
            continue
        folders.setdefault(layout.world_size, []).append((case, out))
    for world, items in folders.items():
        found = spawn_cases(_train_one, world, [(case, (str(o), _case(case)[2])) for case, o in items])
        for case, out in items:
            results[case] = found[case] if isinstance(found[case], CaseFailure) else (found[case], read_manifest(out))
    return results


_REFERENCE: dict[tuple, tuple[list[float], dict]] = {}


def _reference(path: Path, optim: OptimConfig) -> tuple[list[float], dict]:
    if (path, optim) not in _REFERENCE:
        final: dict = {}
        _REFERENCE[path, optim] = (reference_losses(load_model_file(path), STEPS, optim, final_state=final), final)
    return _REFERENCE[path, optim]


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_training_matches_single_device(trained, case):
    path, layout, optim = _case(case)
    per_rank, manifest = case_result(trained, case)
    want, single = _reference(path, optim)
    for rank, (losses, _, _) in enumerate(per_rank):
        for step, (got, ref) in enumerate(zip(losses, want, strict=True), start=1):
            assert abs(got - ref) <= REL * abs(ref), f"{case} rank {rank} step {step}: {got} vs {ref}"
    params = gather_parameters(manifest, states={r: st for r, (_, st, _) in enumerate(per_rank)})
    initial = dict(load_model_file(path).build_model(0).named_parameters(remove_duplicate=False))
    rows = compare_parameters(params, single, initial)
    assert {r["fqn"] for r in rows} == set(single)
    share = update_share(rows)
    worst = max(rows, key=lambda r: r["diff_sq"])["fqn"]
    assert share <= DEFAULT_PARAM_RTOL["fp32"], f"{case}: parameters differ by {share:.2e} of the update ({worst})"
    # ranks holding the same experts (one edp group) end with the same experts, bit for bit
    for rank, (_, state, _) in enumerate(per_rank):
        c = layout.coords(rank)
        twin = layout.rank_of(c["dp"] % layout.ep, c["pp"], c["tp"])  # the first rank of this rank's edp group
        for key in state:
            assert torch.equal(state[key], per_rank[twin][1][key]), f"{case}: {key} of rank {rank} vs rank {twin}"


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_one_ep_th_of_the_experts(trained, case):
    """Measured by the --memory-report probe: parameter bytes held = dense + experts / ep."""
    _, layout, _ = _case(case)
    per_rank, manifest = case_result(trained, case)
    for rank, (_, _, memory) in enumerate(per_rank):
        entry = manifest.rank(layout.coords(rank))
        experts = sum(math.prod(t.global_shape) for t in entry.tensors.values() if t.axis == "ep")
        dense = sum(math.prod(t.global_shape) for t in entry.tensors.values()
                    if t.kind == "parameter" and t.axis == "tp")
        assert experts > 0 and dense > 0
        assert memory["psi"] == dense + experts // layout.ep, (case, rank)
        if layout.zero < 2:
            assert memory["params"] == 4 * (dense + experts // layout.ep), (case, rank, memory)
        elif layout.zero == 3:  # between forward and backward: the dense parameters' dp shard, this rank's experts
            assert memory["params"] <= 4 * (math.ceil(dense / layout.dp) + len(entry.tensors) + experts // layout.ep)
            assert memory["params"] >= 4 * (experts // layout.ep), (case, rank, memory)


def test_generated_code_has_the_exchange_as_lines(tmp_path):
    result = compile_model(QWEN, Layout(dp=4, ep=2), out=tmp_path / "out")
    source = result.sources["rank_pp0_tp0.py"]
    for line in ("rt.exchange_counts(cumsum, self.ep)", "rt.all_to_all_dispatch(", "rt.expert_offsets(",
                 "rt.all_to_all_combine(", 'self.ep = groups["ep"]', "torch.empty((2, 32, 32)",
                 "# mlp.experts.gate_up_proj  S(0) on ep  global [4, 32, 32]", "ignore=["):
        assert line in source, line
    assert source.count("rt.all_to_all_dispatch(") == 1  # in the block class, run by both layers
    manifest = result.manifest
    assert [e.coords for e in manifest.ranks] == [{"dp": 0, "pp": 0, "tp": 0, "ep": e} for e in range(2)]
    assert [e.global_ranks for e in manifest.ranks] == [(0, 2), (1, 3)]
    shards = sorted(p.name for p in (tmp_path / "out" / "weights").iterdir())
    assert shards == ["rank_pp0_tp0_ep0.safetensors", "rank_pp0_tp0_ep1.safetensors"]
    t = manifest.ranks[1].tensors["model_layers_0.mlp_experts_down_proj"]
    assert (t.axis, t.placement, t.shape, t.global_shape) == ("ep", "Shard(0)", (2, 32, 16), (4, 32, 16))
    assert "axis" not in manifest.ranks[1].tensors["lm_head_weight"].to_json()


def test_layout_without_ep_writes_no_ep():
    assert "ep" not in Layout(dp=2).to_json()
    assert Layout.from_json(Layout(dp=4, ep=2).to_json()) == Layout(dp=4, ep=2)
    assert Layout(dp=4, ep=2).expert_groups() == {"ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]]}


@pytest.mark.parametrize(("layout", "message"), [
    (dict(dp=4, ep=3), "ep must divide dp; use --ep in [1, 2, 4]"),
    (dict(dp=2, ep=2, tp=2), "--ep 2 with --tp 2"),
    (dict(dp=2, ep=2, pp=2, schedule="zero-bubble"), "--ep 2 with --schedule zero-bubble"),
    (dict(dp=2, ep=2, pp=2, schedule="interleaved-1f1b"), "--ep 2 with --schedule interleaved-1f1b"),
    (dict(dp=2, ep=2, dtype="bf16"), "--ep 2 with --dtype bf16"),
    (dict(dp=2, ep=2, recompute="full"), "--ep 2 with --recompute full"),
    (dict(dp=1, ep=0), "--ep must be at least 1"),
])
def test_unsupported_layouts_are_refused(layout, message):
    with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Layout(**layout)


def test_ep_on_a_model_without_experts_is_refused():
    with pytest.raises(LayoutError, match="LlamaForCausalLM: expected mixture-of-experts layers.*found no mixture"):
        compile_model(ROOT / "samples" / "llama.py", Layout(dp=2, ep=2))


def test_experts_that_do_not_divide_are_refused(tmp_path):
    model = tmp_path / "six_experts.py"
    model.write_text(QWEN.read_text().replace("num_experts=4", "num_experts=6"))
    with pytest.raises(LayoutError, match=r"model.layers.0.mlp.experts: 6 experts cannot be split over ep=4; "
                                          r"use --ep in \[1, 2, 3, 6\]"):
        compile_model(model, Layout(dp=4, ep=4))


AUX, AUX_MASKED = MODELS / "hf_mixtral_aux.py", MODELS / "hf_mixtral_aux_masked.py"
AUX_CASES = {"mixtral-aux-dp2": (AUX, Layout(dp=2)), "mixtral-aux-dp2-ep2": (AUX, Layout(dp=2, ep=2)),
             # counted rows from the mask, 13 and 14 on the two ranks: the row total is all-reduced with the sums
             "mixtral-aux-masked-dp2": (AUX_MASKED, Layout(dp=2))}


@pytest.mark.distributed
def test_load_balancing_loss_under_dp_trains_as_one_device(tmp_path):
    # E * sum_e(fraction routed to e) * (mean probability of e): a product of whole-batch means; per dp rank and
    # averaged it was 7.6e-4 relative off at --dp 2.  passes/router_loss.py all-reduces both means over dp
    items = []
    for case, (path, layout) in AUX_CASES.items():
        out = tmp_path / case
        result = compile_model(path, layout, out=out)
        assert result.sources["rank_pp0_tp0.py"].count("rt.batch_mean(") == 2
        items.append((case, (str(out), OptimConfig())))
    found = spawn_cases(_train_one, 2, items)
    for case, (path, _) in AUX_CASES.items():
        want, single = _reference(path, OptimConfig())
        initial = dict(load_model_file(path).build_model(0).named_parameters(remove_duplicate=False))
        per_rank = case_result(found, case)
        for rank, (losses, _, _) in enumerate(per_rank):
            for step, (got, ref) in enumerate(zip(losses, want, strict=True), start=1):
                assert abs(got - ref) <= REL * abs(ref), f"{case} rank {rank} step {step}: {got} vs {ref}"
        params = gather_parameters(read_manifest(tmp_path / case), states={r: st for r, (_, st, _) in
                                                                             enumerate(per_rank)})
        share = update_share(compare_parameters(params, single, initial))
        assert share <= DEFAULT_PARAM_RTOL["fp32"], f"{case}: parameters differ by {share:.2e} of the update"


def test_load_balancing_loss_under_pipeline_microbatches_is_refused():
    with pytest.raises(LayoutError, match="load-balancing loss .* product of two whole-batch means, which pipeline "
                                          "microbatches"):
        compile_model(AUX, Layout(pp=2))
    compile_model(AUX, Layout())  # one device, one batch: exact, allowed


def test_load_balancing_loss_under_grad_accumulation_is_refused(tmp_path):
    # --grad-accum k is one step over k batches; each batch would compute the two means on its own (two different
    # batches of this model: 4.4e-5 relative in the loss), so fxshard run and verify refuse it before launching
    from fxshard.cli.app import app
    from typer.testing import CliRunner

    from fxshard.train.options import RunOptions, check_run_options

    out = tmp_path / "out"
    compile_model(MODELS / "hf_mixtral_aux.py", Layout(), out=out)
    check_run_options(out, RunOptions(optim=OptimConfig(grad_accum=1)))
    with pytest.raises(LayoutError, match=r"--grad-accum 2: MixtralForCausalLM adds its load-balancing loss .*"
                                          r"each accumulated batch would compute on its own .* --grad-accum 1"):
        check_run_options(out, RunOptions(optim=OptimConfig(grad_accum=2)))
    run = CliRunner().invoke(app, ["run", str(out), "--steps", "1", "--grad-accum", "2"])
    assert run.exit_code == 2 and "--grad-accum 2: MixtralForCausalLM adds its load-balancing loss" in run.output
    plain = tmp_path / "plain"  # a MoE model without the loss accumulates as before
    compile_model(MIXTRAL, Layout(), out=plain)
    check_run_options(plain, RunOptions(optim=OptimConfig(grad_accum=2)))


def test_checkpoints_of_an_expert_parallel_run_are_refused():
    from fxshard.train.launch import _expert_groups

    # refused before any process group is made (fxshard run --save-every / --resume pass a checkpoint config)
    with pytest.raises(LayoutError, match="--ep 2: checkpoints of expert-parallel runs are not implemented yet"):
        _expert_groups(Layout(dp=2, ep=2), 0, checkpoint=object())


def test_fxshard_check_compares_the_exchanges_of_every_ep_group(tmp_path):
    from fxshard.tools.check import check_output

    compile_model(QWEN, Layout(dp=4, ep=2), out=tmp_path / "out")
    report = check_output(tmp_path / "out")  # runs the rank file on meta tensors, recording every collective
    (group,) = report.groups
    assert group.label == "ep groups [0, 1], [2, 3]"
    # per layer: counts, rows out, rows back forward; the two all-to-alls of the rows again backward
    assert (group.forward, group.backward) == (6, 4)


@pytest.mark.parametrize("path", [QWEN, MIXTRAL])
def test_clipping_changes_the_reference_so_the_clip_cases_test_something(path):
    assert _reference(path, CLIP)[0] != _reference(path, OptimConfig())[0]
