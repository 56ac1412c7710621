"""The batch-norm sync pass: batch normalization in training mode under --dp gets SyncBatchNorm's semantics (the
statistics of every dp rank's rows gathered and combined); pipeline microbatches and --grad-accum, which cannot see
the whole batch at once, are refused naming the op and its module.  Training at dp2 against one device is in
tests/test_training_layouts.py (resnet-bn-*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.errors import LayoutError
from fxshard.ir.context import Layout
from fxshard.train.modules import check_accumulated_loss

RESNET = Path(__file__).resolve().parents[1] / "models" / "hf_resnet_bn.py"
STEM = "resnet.embedder.embedder.normalization"


def test_each_training_batch_norm_gathers_its_statistics_over_dp():
    result = compile_model(RESNET, Layout(dp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert "aten.batch_norm.default(" not in code
    norms = code.count("rt.batch_norm_from_stats(")
    assert norms == code.count("rt.batch_stats(") == len(result.manifest.batch_couplings) >= 5
    assert code.count(", self.dp, dim=0)") == norms  # gather_to of each [2, C] statistics over dp
    assert any(c.startswith(f"{STEM}: aten.batch_norm") for c in result.manifest.batch_couplings)
    assert any("SyncBatchNorm" in note for note in result.ctx.notes)


def test_one_device_records_the_batch_norms_and_rewrites_nothing():
    result = compile_model(RESNET, Layout())
    assert "rt.batch_stats(" not in result.sources["rank_pp0_tp0.py"]
    assert result.manifest.batch_couplings


def test_pipeline_microbatches_are_refused_naming_op_and_module():
    with pytest.raises(LayoutError, match=rf"2 microbatches: {STEM}: aten.batch_norm.default \(batch statistics\)"):
        compile_model(RESNET, Layout(pp=2, microbatches=2))


def test_grad_accum_is_refused_naming_op_and_module(tmp_path):
    result = compile_model(RESNET, Layout(dp=2), out=tmp_path / "out")
    check_accumulated_loss(tmp_path / "out", result.manifest, 1)
    with pytest.raises(LayoutError, match=rf"--grad-accum 2: {STEM}: aten.batch_norm.default"):
        check_accumulated_loss(tmp_path / "out", result.manifest, 2)
