"""The batch-rows pass: an op whose row depends on other rows of the batch (``fxshard/ir/rows.py``) runs on the whole
batch under --dp, its operands gathered and its rows taken back; pipeline microbatches and --grad-accum, which cannot
see the whole batch at once, are refused naming the op, its module and the model's line.  Training each model at
dp2 against one device is in tests/test_rows_layouts.py; each of these failed on the main branch before (compiled
and trained silently wrong)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.errors import LayoutError
from fxshard.ir.context import Layout
from fxshard.train.modules import check_accumulated_loss

MODELS = Path(__file__).resolve().parents[1] / "models"
CORPUS = {  # model file -> what its refusal names first: module, op, node, line of the model file
    "rows_router_view": r"layers\.0: aten\.view\.default \(view, rows_router_view\.py:24\)",
    "rows_reshape": r"model: aten\.reshape\.default \(reshape, rows_reshape\.py:23\)",
    "rows_flatten_split": r"model: aten\.split_with_sizes\.default \(split_with_sizes, rows_flatten_split\.py:24\)",
    "rows_batch_sum": r"model: aten\.sub\.Tensor \(sub, rows_batch_sum\.py:21\)",
    "rows_batch_sort": r"model: aten\.argsort\.default \(argsort, rows_batch_sort\.py:22\)",
    "rows_batch_cumsum": r"model: aten\.cumsum\.default \(cumsum, rows_batch_cumsum\.py:21\)",
}


@pytest.mark.parametrize("model", [m if m == "rows_router_view" else pytest.param(m, marks=pytest.mark.slow)
                                   for m in CORPUS])
def test_pipeline_microbatches_refuse_an_op_mixing_rows_naming_it(model):
    with pytest.raises(LayoutError, match=rf"^--pp 2 with 2 microbatches: {CORPUS[model]} mixes the rows of the "
                                          r"batch: .*train the batch over --dp instead"):
        compile_model(MODELS / f"{model}.py", Layout(pp=2))


def test_under_dp_the_router_runs_on_the_whole_batch_and_gives_back_its_rows(tmp_path):
    result = compile_model(MODELS / "rows_router_view.py", Layout(dp=2), out=tmp_path / "out")
    code = result.sources["rank_pp0_tp0.py"]
    assert "gather_to = rt.gather_to(linear, self.dp, dim=0)" in code  # the router logits of every rank's tokens
    assert "aten.view.default(gather_to, [2, 32, 2])" in code  # the whole batch's view: 4 x 8 tokens, not 2 x 8
    assert "rt.own_rows(slice, self.dp, dim=0)" in code  # this rank's 16 tokens of expert 0's routing weight
    assert any("4 op(s) mix the rows of the batch" in n for n in result.manifest.notes)
    assert result.manifest.batch_couplings[0] == ("layers.0: aten.view.default (view, rows_router_view.py:24) "
                                                  "(mixes the rows of the batch)")
    check_accumulated_loss(tmp_path / "out", result.manifest, 1)
    with pytest.raises(LayoutError, match=r"--grad-accum 2: layers\.0: aten\.view\.default \(view, "
                                          r"rows_router_view\.py:24\) \(mixes the rows of the batch\)"):
        check_accumulated_loss(tmp_path / "out", result.manifest, 2)


def test_a_model_computing_each_row_from_its_own_is_left_as_it_is():
    result = compile_model(MODELS / "tiny_gpt.py", Layout(dp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert "rt.gather_to(" not in code and "rt.own_rows(" not in code and not result.manifest.batch_couplings


def test_a_summed_loss_is_scaled_by_the_parts_training_averages(tmp_path):
    path = tmp_path / "summed.py"
    path.write_text((MODELS / "noisy.py").read_text().replace("out.pow(2).mean()", "out.pow(2).sum()"))
    code = compile_model(path, Layout(dp=2, pp=2)).sources["rank_pp1_tp0.py"]
    assert "aten.mul.Tensor(sum_1, 4.0)" in code  # 2 dp ranks x 2 microbatches: their average is one device's sum


_CHANCE = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)                               # [b, 8, 8]
        first = h[:, 0, :]                             # [b, 8]: each example's first token
        column = h.sum(0)[:, :1]                       # [8, 1]: a sum over the batch, one column
        return (first @ column).pow(2).mean()


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(2, 8, 8),)
'''


def test_a_product_whose_sizes_equal_the_rows_by_chance_is_not_taken_for_a_contrastive_one(tmp_path):
    # at one row per dp rank, [1, 8] @ [8, 1] has the sizes of a product of every example with every other; the
    # analysis sees its right operand is a sum over the batch, not the examples' columns: batch_gather would have
    # gathered that sum's column as rows; the product is computed on the whole batch, the sum summed over the ranks
    path = tmp_path / "chance.py"
    path.write_text(_CHANCE)
    result = compile_model(path, Layout(dp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert not any("a product of every example" in c for c in result.manifest.batch_couplings)
    assert "rt.gather_to(unsqueeze_default, self.dp, dim=0)" in code  # the ranks' sums, summed: the whole batch's
