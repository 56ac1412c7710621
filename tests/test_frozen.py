"""Frozen parameters (``requires_grad=False`` in the model): no gradient, no optimizer state and no update at any
layout or ZeRO stage, still split, loaded, saved and exported.

``hf_llama_frozen.py`` freezes a vocabulary-split embedding, a column-parallel weight and a replicated norm;
``hf_deepseek_v3_frozen.py`` holds its routers' score-correction bias as a frozen parameter (ZeRO 1 stopped on it
with "got no gradient"), and at ``--pp 2 --ep 2`` its first stage holds no experts ("optimizer got an empty
parameter list" at ZeRO 3).  Each case trains 3 AdamW steps on real gloo process groups and must match one device
(losses 1e-5 relative, parameters 1e-3 of the update), its frozen parameters bit-identical to their initial values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import assert_matches_single_device, compile_and_train, single_device, spawn

from fxshard.capture.modelfile import load_model_file
from fxshard.check.verify import gather_parameters
from fxshard.cost.costs import plan_costs
from fxshard.cost.zero_memory import formula, frozen_formula
from fxshard.driver import compile as compile_model
from fxshard.ir.layout import Layout
from fxshard.testing import case_result, matrix, measure_on_rank, selected_cases
from fxshard.train.checkpoint import CheckpointConfig, CheckpointReader
from fxshard.train.memory import report_rows
from fxshard.train.optim import OptimConfig

MODELS = Path(__file__).resolve().parent / "models"
LLAMA, DEEPSEEK = MODELS / "hf_llama_frozen.py", MODELS / "hf_deepseek_v3_frozen.py"
STEPS = 3
REL, BF16_REL = 1e-5, 2e-2
CASES = {
    **{f"llama-dp2-zero{z}": (LLAMA, Layout(dp=2, zero=z), OptimConfig()) for z in (0, 1, 2, 3)},
    "llama-tp2": (LLAMA, Layout(tp=2), OptimConfig()),
    "llama-pp2": (LLAMA, Layout(pp=2), OptimConfig()),
    "llama-dp2-zero1-bf16-clip": (LLAMA, Layout(dp=2, zero=1, dtype="bf16"), OptimConfig(clip_grad_norm=0.05)),
    "llama-dp2-zero0-bf16": (LLAMA, Layout(dp=2, dtype="bf16"), OptimConfig()),
    "llama-tp2-dp2-zero3": (LLAMA, Layout(tp=2, dp=2, zero=3), OptimConfig()),
    "deepseek-dp2-zero1": (DEEPSEEK, Layout(dp=2, zero=1), OptimConfig()),
    "deepseek-pp2-dp2-zero3-ep2": (DEEPSEEK, Layout(pp=2, dp=2, zero=3, ep=2), OptimConfig()),
}


def _frozen(path: Path) -> dict[str, torch.Tensor]:
    model = load_model_file(path).build_model(0)
    return {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}


# make test's representatives (ZeRO 1 and 3 in fp32 and bf16 with clipping, a MoE with a frozen router bias at pp2
# dp2 ZeRO 3 ep2); make test-matrix runs every case
KEEP = ("llama-dp2-zero3", "llama-dp2-zero1-bf16-clip", "deepseek-pp2-dp2-zero3-ep2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    return compile_and_train({case: CASES[case] for case in selected_cases(request, CASES)}, tmp_path_factory, STEPS)


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_frozen_parameters_train_as_on_one_device_and_stay_put(trained, case):
    path, layout, optim = CASES[case]
    per_rank, manifest = case_result(trained, case)
    want, single = single_device(path, STEPS, optim, layout.dtype)
    assert_matches_single_device(case, path, layout, per_rank, manifest, want, single,
                                 BF16_REL if layout.mixed else REL)
    params = gather_parameters(manifest, states={r: st for r, (_, st, *_) in enumerate(per_rank)})
    frozen = _frozen(path)
    assert frozen
    for name, initial in frozen.items():  # at the compute dtype, as one device's mixed-precision recipe holds it
        assert torch.equal(params[name].float(), initial.to(layout.compute_dtype).float()), f"{case}: {name} moved"


def test_a_frozen_parameter_is_generated_without_gradient_and_still_split():
    result = compile_model(LLAMA, Layout(tp=2))
    code = result.sources["rank_pp0_tp0.py"]
    frozen = [line for line in code.splitlines() if "requires_grad=False" in line]
    assert len(frozen) == 3 and all(line.rstrip().endswith("frozen") for line in frozen), frozen
    gate = next(line for line in frozen if "gate_proj" in line)
    assert "torch.empty((32, 32)" in gate and "S(0) on tp" in gate  # 64 rows over tp=2
    assert not any("requires_grad=False" in line for line in code.splitlines() if "up_proj" in line)
    tensors = result.manifest.rank(result.manifest.layout.coords(0)).tensors
    assert {t.source for t in tensors.values()} >= set(_frozen(LLAMA))


def _train_saving(rank: int, world: int, out: str, steps: int, ckpt: CheckpointConfig):
    from harness import run_options

    from fxshard.train.launch import train

    return train(Path(out), run_options(steps, OptimConfig(), ckpt), log=lambda *_: None)


@pytest.mark.distributed
def test_frozen_parameters_are_saved_without_optimizer_state_resumed_and_exported(tmp_path):
    from safetensors.torch import load_file

    from fxshard.train.export import export_hf

    saving, resuming = tmp_path / "dp2-bf16", tmp_path / "tp2-bf16"
    compile_model(LLAMA, Layout(dp=2, dtype="bf16"), out=saving)
    compile_model(LLAMA, Layout(tp=2, dtype="bf16"), out=resuming)
    ckpt = tmp_path / "ckpt"
    uninterrupted = spawn(_train_saving, 2, str(saving), 4, CheckpointConfig(ckpt, 2), timeout=600)[0]
    again = spawn(_train_saving, 2, str(resuming), 4, CheckpointConfig(ckpt / "step-00000002", resume=True),
                  timeout=600)[0]
    assert len(again) == 2 and all(abs(g - w) <= BF16_REL * abs(w) for g, w in zip(again, uninterrupted[2:],
                                                                                     strict=True)), again
    reader = CheckpointReader(ckpt)
    frozen = _frozen(LLAMA)
    for name, initial in frozen.items():
        assert not reader.has_state(name), name
        assert torch.equal(reader.tensor(name), initial.to(torch.bfloat16).float()), name
    assert reader.has_state("model.layers.0.mlp.up_proj.weight")
    export_hf(ckpt, tmp_path / "hf")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name in frozen:
        assert torch.equal(exported[name].float(), reader.tensor(name)), name


def _counts(path: Path) -> tuple[int, int]:
    """(trained, frozen): elements of the model's parameters that train and that do not."""
    params = list(load_model_file(path).build_model(0).parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params if not p.requires_grad)


@pytest.mark.slow
def test_the_plan_holds_no_gradient_or_optimizer_state_for_a_frozen_parameter():
    """``fxshard plan``'s model state: a frozen parameter is held (whole in the compute dtype; under FSDP2 as its
    fp32 shard), and has no gradient and no Adam state at any ZeRO stage; the peak counts neither."""
    trained, frozen = _counts(LLAMA)
    assert frozen > 0.2 * (trained + frozen)  # the embedding: a plan that counted it as trained would be far off
    for dtype in ("fp32", "bf16"):
        for zero in (0, 1, 2, 3):
            mixed = dtype == "bf16"
            (rank,) = plan_costs(LLAMA, Layout(dp=2, zero=zero, dtype=dtype)).ranks
            want, still = formula(zero, 2, mixed, trained), frozen_formula(zero, 2, mixed, frozen)
            assert (rank["psi"].value, rank["frozen_psi"].value) == (trained + frozen, frozen)
            assert (rank["grads"].value, rank["optimizer"].value) == (want["grads"], want["optimizer"]), (dtype, zero)
            assert rank["params"].value == want["params"] + still["params"], (dtype, zero)
            assert rank["model_state"].value == rank["params_peak"].value + want["grads"] + want["optimizer"]


MEMORY_CASES = {"fp32-zero0": Layout(dp=2), "fp32-zero1": Layout(dp=2, zero=1), "fp32-zero3": Layout(dp=2, zero=3),
                "bf16-zero1": Layout(dp=2, zero=1, dtype="bf16")}


@pytest.mark.distributed
@pytest.mark.matrix  # make test-matrix: make test checks the plan's frozen bytes without a run (above)
def test_measured_model_state_of_frozen_parameters_is_what_the_plan_says(tmp_path):
    """One step on two gloo ranks: the bytes each rank holds (``fxshard run --memory-report``'s walk of its tensors)
    are the plan's, category by category (Adam's step counters and ZeRO 1's whole-tensor imbalance aside)."""
    outs = {name: str(compile_model(LLAMA, layout, out=tmp_path / name).out) for name, layout in MEMORY_CASES.items()}
    per_rank = spawn(measure_on_rank, 2, outs, timeout=600)
    params = [p for p in load_model_file(LLAMA).build_model(0).parameters() if p.requires_grad]
    for name, layout in MEMORY_CASES.items():
        (plan,) = plan_costs(LLAMA, layout).ranks
        slack = 8 * len(params) + ((4 if layout.mixed else 0) + 8) * max(p.numel() for p in params) * (layout.zero == 1)
        for row in report_rows([r[name] for r in per_rank], layout):
            assert row["frozen"] == plan["frozen_psi"].value
            for key in ("params", "grads", "optimizer"):
                assert abs(row[key] - plan[key].value) <= (slack if key == "optimizer" else 0), (
                    f"{name} rank {row['rank']} {key}: measured {row[key]} bytes, plan {plan[key].value:.0f}")
                assert plan[key].value == row["formula"][key], (name, key)
