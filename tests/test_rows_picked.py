"""Rows a model selects, under a split batch (``fxshard/ir/rows_picked.py``, issue 43 §3).

An eager experts loop (``tests/models/picked_experts_loop.py``, DBRX's and Switch Transformers' shape: a loop over the
experts the batch hit, ``torch.where`` numbering each expert's rows, ``index_add_`` writing the results back by them)
computes each token from its own row: at --dp 2 it trains as on one device.  Before, the analysis computed the loop
on the whole batch and the compile failed at ``nonzero``'s size.  Near misses are refused at compile, naming the op
and the model's line: the numbers used on a tensor they do not number, a selection's count used as a number, a mean
over a selection (each would give every rank its own part's value, silently: the count 0.17 and the mean 2.5e-3 of
the update off at dp2 before the refusal).

Image features put in place of image tokens (``tests/models/picked_image_tokens.py``, Llava's shape: features joined
back whole with ``torch.cat(list(x))``, the token count asserted against them, ``masked_scatter``) scatter each part's
images into its own tokens: exact at --dp 2.  Before, the capture at twice the rows was another program (one
``unbind`` value per image) and the compile was refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fxshard.compiler import compile_program
from fxshard.driver import verify
from fxshard.errors import LayoutError
from fxshard.ir.context import Layout
from fxshard.ir.placement import Replicate, Shard
from fxshard.testing import matrix

MODEL = Path(__file__).resolve().parent / "models" / "picked_experts_loop.py"
IMAGES = MODEL.with_name("picked_image_tokens.py")


@pytest.mark.slow
def test_the_row_numbers_index_their_own_rows_and_the_loop_is_the_example_batchs():
    from fxshard.ir.rows_picked import Picked

    ctx = compile_program(MODEL, Layout(dp=2)).ctx
    rows, nodes = ctx.rows, {n.name: n for n in ctx.program.gm.graph.nodes}
    assert not rows.mixing and not rows.checks and not rows.whole
    wheres = [n for n in nodes.values() if n.op == "call_function" and n.target.__name__ == "where.default"]
    assert len(wheres) == 3  # one per expert the example batch hit, each part's own rows
    assert all(rows.place[w.name] == (Shard(0), Picked(0, 32)) for w in wheres)  # slot, row: 2 x 16 tokens
    hit = next(n for n in nodes.values() if n.op == "call_function" and n.target.__name__ == "greater.Scalar")
    assert rows.place[hit.name] == Replicate()  # every value of its nonzero asserted: the example's experts
    writes = [n for n in nodes.values() if n.op == "call_function" and n.target.__name__ == "index_add_.default"]
    assert [rows.place[w.name] for w in writes] == [Shard(0)] * 3


@pytest.mark.distributed
@pytest.mark.slow
def test_an_experts_loop_trains_like_one_device_at_dp2():
    result = verify(MODEL, Layout(dp=2), steps=3)
    assert result.ok, result.summary()


NEAR_MISSES = {  # the model's picking line, rewritten -> the refusal
    "numbers-index-another-tensor": (
        "y = (self.embed.weight[rows] @ self.experts[e].squeeze(0)) * top.values[rows, slot, None]",
        r"aten\.index\.Tensor \(index_\d+, picked_experts_loop\.py:\d+\) mixes the rows of the batch: it reads the "
        r"numbers of rows torch\.where picked .* other than to index.*train at --dp 1"),
    "count-as-a-number": (
        "y = (flat[rows] @ self.experts[e].squeeze(0)) * top.values[rows, slot, None] / rows.shape[0]",
        r"--dp 2: model: aten\.div\.Tensor \(div, picked_experts_loop\.py:\d+\) uses sym_size_int_\d+, the count of a "
        r"selection of the batch's rows .* as a number"),
    "numbers-in-a-narrow-dtype": (  # uint8 wraps the whole batch's numbers past 255, not a part's: at 320 tokens
        # (B, S = 4, 80) this trained 6.4e-3 (losses) and 0.65 of the update off one device before the refusal
        "y = (flat[rows.to(torch.uint8).long()] @ self.experts[e].squeeze(0)) * top.values[rows, slot, None]",
        r"aten\.to\.dtype \(to, picked_experts_loop\.py:\d+\) mixes the rows of the batch: it "
        r"reads the numbers of rows torch\.where picked .* other than to index"),
    "half-a-selection": (  # before: a TypeError from inside the compile (a slice's end the data decides)
        "y = (flat[rows] @ self.experts[e].squeeze(0)) * top.values[rows, slot, None]; "
        "out = out + y[: rows.shape[0] // 2].sum()",
        r"aten\.slice\.Tensor \(slice_\d+, picked_experts_loop\.py:\d+\) mixes the rows of the batch"),
    "mean-of-a-selection": (
        "y = (flat[rows] @ self.experts[e].squeeze(0)) * top.values[rows, slot, None]; out = out + y.mean()",
        r"--dp 2: model: aten\.mean\.default \(mean, picked_experts_loop\.py:\d+\) averages a selection of the batch's "
        r"rows"),
}


@pytest.mark.parametrize("case", matrix(NEAR_MISSES, ("count-as-a-number",)))
def test_row_numbers_or_counts_read_across_the_batch_are_refused(tmp_path, case):
    line, refusal = NEAR_MISSES[case]
    model = tmp_path / "picked_experts_loop.py"
    model.write_text(re.sub(r"y = .*# PICK", line, MODEL.read_text()))
    with pytest.raises(LayoutError, match=refusal):
        compile_program(model, Layout(dp=2))


@pytest.mark.slow
def test_image_features_scatter_into_each_parts_own_tokens():
    import torch

    ctx = compile_program(IMAGES, Layout(dp=2)).ctx
    targets = {n.target for n in ctx.program.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.unbind.int not in targets and torch.ops.aten.flatten.using_ints in targets  # rejoined
    scatter = next(n for n in ctx.program.gm.graph.nodes if n.target is torch.ops.aten.masked_scatter.default)
    assert ctx.rows.place[scatter.name] == Shard(0) and not ctx.rows.mixing and not ctx.rows.checks


@pytest.mark.distributed
@pytest.mark.slow
def test_image_features_train_like_one_device_at_dp2():
    result = verify(IMAGES, Layout(dp=2), steps=3)
    assert result.ok, result.summary()


def test_a_scatter_whose_counts_no_part_checks_is_not_split(tmp_path):
    model = tmp_path / "picked_image_tokens.py"  # without the check a part's tokens could take another's features
    model.write_text(re.sub(r".*# CHECK\n", "", IMAGES.read_text()))
    with pytest.raises(LayoutError, match=r"computed on the whole batch under --dp 2"):
        compile_program(model, Layout(dp=2))


SELECTION_MIXED = '''import torch
import torch.nn as nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.proj(x)[mask].cumsum(0).pow(2).mean()


def make_model():
    return M()


def make_inputs():
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(4, 6, 8, generator=g), "mask": torch.rand(4, 6, generator=g) > 0.5}
'''


def test_a_selection_an_op_needs_whole_is_refused_naming_it(tmp_path):
    # a cumulative sum over the entries a boolean mask selects: each rank's count differs, no gather takes them
    # (before: a TypeError from inside the compile)
    model = tmp_path / "selection_mixed.py"
    model.write_text(SELECTION_MIXED)
    with pytest.raises(LayoutError, match=r"aten\.cumsum\.default \(cumsum, selection_mixed\.py:11\) mixes the rows .*"
                                          r"a selection of each rank's rows .* train at --dp 1"):
        compile_program(model, Layout(dp=2))


BRANCH = MODEL.with_name("picked_count_branch.py")


def test_a_branch_a_count_over_the_batch_did_not_take_is_refused(tmp_path):
    # a count equal to its parts' sum holds on the whole batch when it holds on every part, not when it fails on every
    # part: sums 2 and 6 against 4 each, 8 against 8 (before: compiled, and trained 8.8e-2 off one device at dp2)
    with pytest.raises(LayoutError, match=r"aten\.eq\.Scalar \(eq_1, picked_count_branch\.py:\d+\) computes a value "
                                          r"over the rows of the batch that data-dependent code reads"):
        compile_program(BRANCH, Layout(dp=2))
    model = tmp_path / "picked_count_branch.py"  # two image tokens in every row: each part takes the branch, as does
    model.write_text(BRANCH.read_text().replace("ids[2, 1:4] = ids[3, 1:4] = IMAGE", "ids[:, 1:3] = IMAGE"))
    assert not compile_program(model, Layout(dp=2)).ctx.rows.checks  # the whole batch


def test_a_count_over_the_rows_read_as_a_number_is_refused():
    # int(mask.sum()) is each part's own count, the program specialized on it (before: compiled, and trained 4.6e-2
    # (losses) and 0.41 of the update off one device at dp2)
    with pytest.raises(LayoutError, match=r"aten\.sum\.default \(sum_1, picked_count_read\.py:\d+\) computes a value "
                                          r"over the rows of the batch that data-dependent code reads"):
        compile_program(MODEL.with_name("picked_count_read.py"), Layout(dp=2))
