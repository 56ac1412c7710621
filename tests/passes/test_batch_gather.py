"""The batch-gather pass: a product of every example with every other (a contrastive loss's image @ text.T) under
--dp runs on the whole batch, its operands gathered over dp; pipeline microbatches and --grad-accum, which cannot
see the whole batch at once, are refused naming the op and its module.  Training at dp2 against one device is in
tests/test_training_layouts.py (contrastive-*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.errors import LayoutError
from fxshard.ir.context import Layout
from fxshard.train.modules import check_accumulated_loss

CONTRASTIVE = Path(__file__).resolve().parents[1] / "models" / "contrastive.py"
SIGLIP = Path(__file__).resolve().parents[1] / "models" / "hf_siglip.py"
PRODUCT = r"Contrastive: aten.matmul.default \(a product of every example with every other\)"


def test_the_product_runs_on_features_gathered_over_dp():
    result = compile_model(CONTRASTIVE, Layout(dp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert "rt.gather_to(mul, self.dp, dim=0)" in code  # the scaled image features, [B, d]
    assert "rt.gather_to(t, self.dp, dim=1)" in code  # the text features, transposed: [d, B]
    assert "arange.default(4," in code  # the labels of the whole batch (4 examples; 2 per rank)
    assert "rt.token_mean(" not in code  # the loss is the whole batch's mean on every rank, divided by nothing else
    assert [c for c in result.manifest.batch_couplings if "matmul" in c] == [
        "Contrastive: aten.matmul.default (a product of every example with every other)"]


def test_siglip_targets_made_at_the_part_size_are_made_at_the_whole_batch():
    # SigLIP's loss builds its targets as 2 * eye(B) - 1 from the logits' size: eye(2) on a part, which the
    # whole-batch logits [4, 4] could not take ("fails at its size" before); made again at eye(4)
    code = compile_model(SIGLIP, Layout(dp=2)).sources["rank_pp0_tp0.py"]
    assert "aten.eye.default(4," in code and "aten.eye.default(2," not in code
    assert "mul_tensor = aten.mul.Tensor(eye_default, 2)" in code  # the op on it made again, on the whole batch
    assert code.count("rt.gather_to(") == 2  # text and image features; the targets are made, not gathered


def test_one_device_records_the_product_and_rewrites_nothing():
    result = compile_model(CONTRASTIVE, Layout())
    assert "rt.gather_to(" not in result.sources["rank_pp0_tp0.py"]
    assert result.manifest.batch_couplings


def test_pipeline_microbatches_are_refused_naming_op_and_module():
    with pytest.raises(LayoutError, match=rf"2 microbatches: {PRODUCT} pairs the examples"):
        compile_model(CONTRASTIVE, Layout(pp=2, microbatches=2))


def test_grad_accum_is_refused_naming_op_and_module(tmp_path):
    result = compile_model(CONTRASTIVE, Layout(dp=2), out=tmp_path / "out")
    check_accumulated_loss(tmp_path / "out", result.manifest, 1)
    with pytest.raises(LayoutError, match=rf"--grad-accum 2: {PRODUCT} mixes the examples"):
        check_accumulated_loss(tmp_path / "out", result.manifest, 2)


def test_zero_3_refuses_the_scalar_logit_scale_at_compile_naming_it():
    # FSDP2 refuses a 0-dim parameter when the run starts; the compile says so first
    with pytest.raises(LayoutError, match=r"--zero 3: logit_scale is a 0-dim parameter, which FSDP2"):
        compile_model(CONTRASTIVE, Layout(dp=2, zero=3))
