"""What capture must carry beyond parameters and buffers trains exactly under every layout: tensors a
model makes inside ``forward`` (lifted constants), Hugging Face Falcon and T5 which make them.  Random
ops other than dropout draw each rank's part of one device's values (the noisy-* cases).  A
custom autograd.Function keeps its backward (an fxshard_fn custom op) and trains as on one device.

Each case is compiled here and trained 3 AdamW steps on real gloo process groups through
``fxshard.train.launch.train`` (the code ``fxshard run`` runs), all cases in one spawn of 2 processes; losses
must match single-device training within 1e-5 relative and the trained parameters within verify's
share of the update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import spawn

from fxshard.capture.modelfile import load_model_file
from fxshard.check.verify import DEFAULT_PARAM_RTOL, compare_parameters, gather_parameters, update_share
from fxshard.codegen.manifest import read_manifest
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import matrix, selected_cases
from fxshard.train.reference import reference_losses

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"
STEPS = 3
REL = 1e-5
CASES = {  # id -> (model file, layout[, plan])
    **{f"forward-constants-{n}": (MODELS / "forward_constants.py", lay) for n, lay in
       (("tp2", Layout(tp=2)), ("pp2", Layout(pp=2)))},
    # the plan splits the activations the constants multiply and index: they meet split tensors
    "forward-constants-tp2-split-plan": (MODELS / "forward_constants.py", Layout(tp=2),
                                         {"blocks.*.fc_in": "colwise", "blocks.*.fc_out": "rowwise"}),
    **{f"falcon-{n}": (MODELS / "hf_falcon.py", lay) for n, lay in (("tp2", Layout(tp=2)), ("pp2", Layout(pp=2)))},
    **{f"t5-{n}": (MODELS / "hf_t5.py", lay) for n, lay in (("tp2", Layout(tp=2)), ("pp2", Layout(pp=2)))},
    # a straight-through estimator as a custom op with its autograd registered (the refused Function's fix)
    **{f"straight-through-op-{n}": (MODELS / "straight_through_op.py", lay)
       for n, lay in (("tp2", Layout(tp=2)), ("pp2", Layout(pp=2)))},
    # a custom autograd.Function (straight-through: round forward, identity backward) with a constant argument,
    # run as a custom op whose backward is the Function's; elementwise, so the split plan keeps it split over tp
    **{f"straight-through-fn-{n}": (MODELS / "straight_through_fn.py", lay)
       for n, lay in (("tp2", Layout(tp=2)), ("pp2", Layout(pp=2)))},
    "straight-through-fn-tp2-split-plan": (MODELS / "straight_through_fn.py", Layout(tp=2),
                                           {"blocks.*.fc_in": "colwise", "blocks.*.fc_out": "rowwise"}),
    # rand_like replicated over the tp ranks: each draws the whole tensor from the same seeded generator
    "noisy-tp2": (MODELS / "noisy.py", Layout(tp=2)),
    "noisy-tp2-split-plan": (MODELS / "noisy.py", Layout(tp=2), {"blocks.*.fc_in": "colwise",
                                                                  "blocks.*.fc_out": "rowwise"}),
}


def _train_all(rank: int, world: int, outs: list[str]):
    from fxshard.train.launch import train
    from fxshard.train.optim import OptimConfig
    from fxshard.train.options import RunOptions

    results = {}
    for out in outs:
        state: dict = {}
        results[out] = (train(Path(out), RunOptions(STEPS, OptimConfig()), log=lambda *_: None, final_state=state),
                        state)
    return results


# make test's representatives (constants meeting split tensors, an encoder-decoder's stages, a custom autograd
# Function under a split plan, replicated randomness); make test-matrix runs every case
KEEP = ("forward-constants-tp2-split-plan", "t5-pp2", "straight-through-fn-tp2-split-plan", "noisy-tp2-split-plan")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    outs = {}
    for case in selected_cases(request, CASES):
        path, layout, *plan = CASES[case]
        outs[case] = tmp_path_factory.mktemp(case)
        compile_model(path, layout, out=outs[case], plan=plan[0] if plan else None)
    per_rank = spawn(_train_all, 2, [str(o) for o in outs.values()], timeout=600)
    return {case: ([r[str(o)] for r in per_rank], read_manifest(o))
            for case, o in outs.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_trains_as_on_one_device(trained, case):
    path, layout, *_ = CASES[case]
    per_rank, manifest = trained[case]
    single: dict = {}
    want = reference_losses(load_model_file(path), STEPS, final_state=single)
    for rank, (losses, _) in enumerate(per_rank):
        for step, (got, ref) in enumerate(zip(losses, want, strict=True), start=1):
            assert abs(got - ref) <= REL * abs(ref), f"{case} rank {rank} step {step}: {got} vs {ref}"
    params = gather_parameters(manifest, states={r: st for r, (_, st) in enumerate(per_rank)})
    initial = dict(load_model_file(path).build_model(0).named_parameters(remove_duplicate=False))
    share = update_share(compare_parameters(params, single, initial))
    assert share <= DEFAULT_PARAM_RTOL["fp32"], f"{case}: parameters differ by {share:.2e} of the update"


def test_constants_made_in_forward_reach_the_rank_files(tmp_path):
    result = compile_model(MODELS / "forward_constants.py", Layout(tp=2), out=tmp_path)
    constants = [t for e in result.manifest.ranks for t in e.tensors.values() if t.kind == "constant"]
    assert {t.source for t in constants} >= {"lifted_tensor_0", "blocks.3.lifted_tensor_8"}


# Random ops other than dropout draw each rank's elements of one device's values (fxshard.runtime.draws); trained
# against one device at dp2 and pp2 in tests/test_rows_layouts.py.  One outside the ops fxshard draws so (rrelu, a
# model's own generator) is refused under pipeline or data parallelism, naming it (tests/passes/test_dropout.py)
@pytest.mark.parametrize("layout", [Layout(), Layout(pp=2), Layout(dp=2)], ids=["one-device", "pp2", "dp2"])
def test_randomness_other_than_dropout_compiles_as_draws(layout):
    code = compile_model(MODELS / "noisy.py", layout).sources["rank_pp0_tp0.py"]
    assert "rt.draw(aten.rand_like.default, relu, pin_memory=False, site=0" in code


def test_meta_compile_keeps_a_constant_made_inside_forward(tmp_path):
    # --weights captures without weights; Falcon makes index lists inside forward (lifted constants).  Traced on
    # meta tensors they were made on meta, their values unknown, and the compile refused; traced on fake CPU
    # tensors (what a meta compile does now) they are made on the CPU with the values a real capture finds
    mf = load_model_file(MODELS / "hf_falcon.py")
    mf.build_model(0).save_pretrained(tmp_path / "ckpt")
    meta = compile_model(MODELS / "hf_falcon.py", Layout(tp=2), weights=tmp_path / "ckpt").ctx.program.tensors
    real = compile_model(MODELS / "hf_falcon.py", Layout(tp=2)).ctx.program.tensors
    lifted = sorted(k for k in real if "lifted_tensor" in k)
    assert lifted and all(torch.equal(meta[k], real[k]) for k in lifted), lifted
