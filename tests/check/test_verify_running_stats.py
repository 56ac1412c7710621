"""``fxshard verify`` on batch norms' running statistics (fxshard/check/verify.py ``compare_running_stats``).

Batch normalization in training mode updates its running mean and variance and never reads them, so neither the
losses nor the trained parameters show them wrong: a running variance made unbiased over a dp rank's part (2 values per
channel at a ResNet's 1x1 maps) instead of the whole batch's (4) passed verify.  Verify now compares them as it does
the parameters, by the share of their own change, at the parameters' tolerance.  Tested here on one device's models
(no process group); the ResNet at dp2 in float64 (tests/check/test_verify_fp64.py) is judged by them on real ranks.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from fxshard.check.verify import Verification, compare_parameters, compare_running_stats, running_stats
from fxshard.ir.context import Layout


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.LayerNorm(2))


def _trained(model: torch.nn.Module, unbiased_over: int | None = None) -> dict[str, torch.Tensor]:
    """One training-mode forward of 4 images' 2x2 maps, the running variance made unbiased over ``unbiased_over``
    values per channel instead of the batch's 16 when given (a dp rank's part)."""
    model.train()
    model(torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(1)))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    if unbiased_over is not None:  # rv = 0.9 + 0.1 * var * n / (n - 1): the same var, another n
        var = (buffers["1.running_var"] - 0.9) / 0.1 * 15 / 16
        buffers["1.running_var"] = 0.9 + 0.1 * var * unbiased_over / (unbiased_over - 1)
    return buffers


def test_running_stats_are_the_batch_norms_floating_means_and_variances():
    assert sorted(running_stats(dict(_net().named_buffers()))) == ["1.running_mean", "1.running_var"]


def test_a_running_variance_unbiased_over_a_part_fails_verify_where_parameters_agree():
    single = _trained(_net())
    good = compare_running_stats(_trained(_net()), single, _net())
    bad = compare_running_stats(_trained(_net(), unbiased_over=8), single, _net())
    assert [r["fqn"] for r in bad] == ["1.running_mean", "1.running_var"]
    params = compare_parameters(dict(_net().named_parameters()), dict(_net().named_parameters()),
                                {n: p - 1 for n, p in _net().named_parameters()})
    ok = Verification(Layout(dp=2), [1.0], [1.0], params, stats=good)
    wrong = Verification(Layout(dp=2), [1.0], [1.0], params, stats=bad)
    assert ok.ok and ok.stats_rel == 0.0
    assert wrong.param_rel == 0.0 and wrong.loss_rel == 0.0  # nothing else shows it
    assert not wrong.ok and wrong.stats_rel > 5 * wrong.param_rtol, wrong.stats_rel  # measured 1.3e-2
    assert (f"the batch norms' running statistics {wrong.stats_rel:.3e} of their update (most 1.running_var)"
            in wrong.summary())
    found = _nccl_matrix().SUMMARY.search(wrong.summary())  # the script that reads verify's line still does
    assert found is not None and found.groups()[-1] == "FAILED", wrong.summary()


def _nccl_matrix():
    script = Path(__file__).resolve().parents[2] / "scripts" / "nccl_matrix.py"
    spec = importlib.util.spec_from_file_location("nccl_matrix", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_model_without_batch_norm_is_judged_as_before():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    assert compare_running_stats({}, {}, model) == []
    assert Verification(Layout(dp=2), [1.0], [1.0], compare_parameters(
        dict(model.named_parameters()), dict(model.named_parameters()),
        {n: p - 1 for n, p in model.named_parameters()})).stats_rel == 0.0
