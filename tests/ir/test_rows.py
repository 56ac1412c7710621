"""Tier 1: the batch-row analysis (``fxshard/ir/rows.py``) on programs exported at two batch sizes.

A value is split by rows only where each row is computed from its own; every way of mixing rows the issue names (a
view across the batch, a reshape across batch and sequence, flattened rows split at another size, a sum over the batch
fed back, a sort or a cumulative sum over the batch) is found and named with its module and the model's line, and the
ways models compute row by row (a classifier's ``logits[arange(B), last]``, an MAE's gathers, a batch of images through
convolutions, a boolean-mask loss, views that keep the batch) are not."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import export
from torch.export.graph_signature import InputKind

from fxshard.errors import LayoutError
from fxshard.ir.placement import Partial, Replicate, Shard
from fxshard.ir.rows import batch_rows
from fxshard.ir.rows_rules import Ids

B, S, H = 2, 6, 8


class Body(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.fn = fn

    def forward(self, x, ids):
        return self.fn(self, self.proj(x), ids)


def _analyse(fn, rows: int = B):
    """The analysis of ``fn(module, h [b, S, H], ids [b, S])`` exported at ``rows`` rows and twice as many."""
    torch.manual_seed(0)
    module = Body(fn)

    def inputs(b):
        return torch.randn(b, S, H), torch.randint(0, S, (b, S))

    one, two = (export(module, inputs(b), strict=False) for b in (rows, 2 * rows))
    users = {s.arg.name for s in one.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    return batch_rows(one.graph_module, two.graph_module, users, "model.py"), one.graph_module


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


MIXING = {  # id -> (forward body, the op named)
    "view across the batch": (lambda m, h, ids: h.reshape(-1, H).view(2, h.shape[0] * S, -1).softmax(0).sum(),
                              "aten.view.default"),
    "reshape across batch and sequence": (lambda m, h, ids: h.reshape(S, h.shape[0], H).softmax(0).sum(),
                                          "aten.reshape.default"),
    "flatten then split at another size": (lambda m, h, ids: torch.cat([p.tanh() for p in h.flatten(0, 1).split(
        [5, h.shape[0] * S - 5])]).sum(), "aten.split_with_sizes.default"),
    "sum over the batch fed back": (lambda m, h, ids: (h * h.sum(0)).sum(), "aten.mul.Tensor"),
    "sort over the batch": (lambda m, h, ids: h.sort(dim=0).values[0].sum(), "aten.sort.default"),
    "cumsum over the batch": (lambda m, h, ids: h.cumsum(0).pow(2).mean(), "aten.cumsum.default"),
    "softmax over the batch": (lambda m, h, ids: h.softmax(0).pow(2).mean(), "aten.softmax.int"),
    "a size of the batch as a number": (lambda m, h, ids: (h * h.shape[0]).mean(), "aten.mul.Tensor"),
    "a write to rows the data picks": (lambda m, h, ids: (torch.zeros(h.shape[0], S).index_put(
        (ids[:, 0] % 2, ids[:, 1]), torch.tensor(1.0)) * h.sum(-1)).mean(), "aten.index_put.default"),
    "a table tiled across the rows": (lambda m, h, ids: (h + m.proj.weight[:2].repeat(3 * h.shape[0] // 2, 1).view(
        h.shape[0], 3, H)[:, :1]).mean(), "aten.repeat.default"),  # odd rows start at the table's second row
}


@pytest.mark.parametrize("case", list(MIXING))
def test_every_way_of_mixing_rows_is_found_and_named(case):
    fn, op = MIXING[case]
    rows, _ = _analyse(fn)
    found = list(rows.mixing.values())
    assert found, f"{case}: nothing found"
    assert any(op in f and "test_rows.py:" in f and "mixes the rows of the batch" in f for f in found), found


SEPARATE = {  # id -> forward body computing each row from its own
    "indexing": lambda m, h, ids: (h[torch.arange(h.shape[0]), ids[:, -1]].pow(2).mean()  # pooled by row numbers
                                   + torch.gather(h, 1, torch.argsort(ids, 1).unsqueeze(-1).repeat(1, 1, H)).mean()
                                   + h[:, torch.randperm(S)].softmax(1).mean()  # an MAE's gathers, a permutation
                                   + (torch.zeros(h.shape[0], S).index_put((torch.arange(h.shape[0]), ids[:, 0]),
                                                                           torch.tensor(1.0)) * h.sum(-1)).mean()),
    "views": lambda m, h, ids: (h.view(h.shape[0], S * H).view(h.shape[0] * S, H).tanh().mean()  # batch-first views
                                + F.cross_entropy(h.transpose(0, 1).reshape(-1, H), ids.t().reshape(-1) % H)
                                + torch.cat([h, 2 * h]).split(h.shape[0])[1].mean()  # along the batch and back
                                + (h + m.proj.weight.expand(h.shape[0], H, H)[:, :S]).mean()  # a weight per row
                                + h.sort(1).values.cumsum(1).mean()  # along the tokens
                                + torch.concatenate([h, h.tanh()], -1).mean()),  # Zamba2's cat, an alias
    # Funnel's attention_mask.type_as(inputs_embeds): the other operand read for its dtype alone
    "a mask cast to the features' dtype": lambda m, h, ids: (h * ids.gt(2).type_as(h).unsqueeze(-1)).mean(),
    # DeBERTa's relative-position keys: [heads, L, d] repeated over the batch, whole copies in every row
    "tiled copies": lambda m, h, ids: torch.bmm(h.reshape(h.shape[0] * 2, S // 2, H), m.proj.weight.view(
        2, H // 2, H).repeat(h.shape[0], 1, 1).transpose(1, 2)).tanh().mean(),
    "boolean mask": lambda m, h, ids: (F.cross_entropy(h[ids > 2], ids[ids > 2] % H)
                                       + h.index_put((ids > 2,), torch.tensor(0.0)).pow(2).mean()),  # x[mask] = 0
    "images": lambda m, h, ids: F.adaptive_avg_pool2d(F.max_pool2d(F.conv2d(h.unsqueeze(1), torch.ones(3, 1, 2, 2)),
                                                                   2), 1).mean(),
}


@pytest.mark.parametrize("case", list(SEPARATE))
def test_programs_computing_each_row_from_its_own_mix_nothing(case):
    rows, gm = _analyse(SEPARATE[case])
    assert not rows.mixing, rows.mixing
    loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert rows.place[loss.name] == Partial("avg")  # a mean over the batch: the parts' losses average to it


def test_the_rows_are_followed_through_views_transposes_and_row_numbers():
    rows, gm = _analyse(lambda m, h, ids: (h.transpose(0, 1).flatten(1, 2)
                                            + h[torch.arange(h.shape[0]), ids[:, 0]].sum()).sum())
    assert rows.place[_node(gm, torch.ops.aten.transpose.int).name] == Shard(1)
    assert rows.place[_node(gm, torch.ops.aten.flatten.using_ints).name] == Shard(1)
    assert rows.place[_node(gm, torch.ops.aten.arange.default).name] == Ids(0)
    assert rows.place[_node(gm, torch.ops.aten.index.Tensor).name] == Shard(0)
    assert rows.place["p_proj_weight"] == Replicate()


def test_a_sum_over_the_batch_divided_by_its_rows_is_a_mean_and_a_sum_a_sum():
    rows, gm = _analyse(lambda m, h, ids: h.sum() / h.shape[0])
    assert not rows.mixing and rows.place[_node(gm, torch.ops.aten.div.Tensor).name] == Partial("avg")
    rows, gm = _analyse(lambda m, h, ids: h.sum((0, 1)).sum())
    assert not rows.mixing and rows.place[_node(gm, torch.ops.aten.sum.default).name] == Partial("sum")
    rows, _ = _analyse(lambda m, h, ids: h.sum() / h.shape[0] + h.sum())  # a mean plus a sum: the parts' losses
    assert rows.mixing  # average to neither


def test_a_draw_of_the_batch_size_keeps_its_rows():
    rows, gm = _analyse(lambda m, h, ids: (h * torch.rand(h.shape[0], S, 1)).mean())
    assert not rows.mixing
    assert rows.place[_node(gm, torch.ops.aten.rand.default).name] == Shard(0)


def test_a_permutation_of_the_batch_needs_the_whole_batch():
    rows, gm = _analyse(lambda m, h, ids: h[torch.randperm(h.shape[0])].pow(2).mean())
    assert _node(gm, torch.ops.aten.randperm.default).name in rows.whole  # drawn whole on every rank, as one device


def test_pieces_of_a_fixed_size_cut_from_the_batch_are_refused():
    # their number follows the batch: no program of the captured size computes the whole batch's
    with pytest.raises(LayoutError, match=r"aten.split.Tensor \(split, test_rows.py:\d+\) gives 3 values at the "
                                          r"captured rows and 5 at twice as many"):
        _analyse(lambda m, h, ids: torch.stack([p.sum() for p in h.flatten(0, 1).split(5)]).mean())


def test_a_program_that_branches_on_the_batch_size_is_refused():
    with pytest.raises(LayoutError, match=r"model.py: the model's program at twice the rows differs .*\(no branch "
                                          r"on the batch size\)"):
        _analyse(lambda m, h, ids: (h * 2 if h.shape[0] > 2 else h.tanh().exp()).mean())


GUARDED = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 5)

    def forward(self, x, labels):
        if labels.max() >= 5:  # a maximum over the rows: every part's value is the whole batch's
            raise ValueError("labels out of range")
        h = self.head(x)
        if COUNT:
            h = h * 2
        return F.cross_entropy(h, labels)


def make_model():
    return Model()


def make_inputs():
    return {"x": torch.randn(4, 4), "labels": torch.tensor([1, 0, 3, 0])}
"""


def test_a_check_of_a_maximum_over_the_rows_keeps_them_and_a_count_is_refused(tmp_path):
    # data-dependent reads specialized on the example batch (fxshard/capture/specialize.py) are runtime checks: each
    # part checks its own rows, which gives one device's branch for a maximum, not for a count (1 per part, 2 whole)
    from fxshard.compiler import compile_program
    from fxshard.ir.context import Layout

    (tmp_path / "max.py").write_text(GUARDED.replace("COUNT", "False"))
    rows = compile_program(tmp_path / "max.py", Layout(dp=2)).ctx.rows
    assert not rows.mixing and not rows.checks and not rows.whole
    (tmp_path / "count.py").write_text(GUARDED.replace("COUNT", "(labels > 0).sum() >= 2"))
    with pytest.raises(LayoutError, match=r"--dp 2: model: aten.ge.Scalar \(ge_1, count.py:\d+\) computes a value "
                                          r"over the rows of the batch that data-dependent code reads"):
        compile_program(tmp_path / "count.py", Layout(dp=2))


@pytest.mark.parametrize("read", ["labels.min() == labels.max()", "(labels == labels.max()).all()",
                                  "(x.amax(0) > 0).all()"], ids=["two-selections", "selection-and-rows", "vector"])
def test_a_selection_combined_on_its_way_to_the_check_is_refused(tmp_path, read):
    # each part agreeing is not the whole agreeing once the selection meets another value: labels [1, 1 | 3, 3]
    # read True in each part and False whole; a column maximum over the rows is a vector, not one value
    from fxshard.compiler import compile_program
    from fxshard.ir.context import Layout

    (tmp_path / "mixed.py").write_text(GUARDED.replace("COUNT", read).replace(
        "torch.tensor([1, 0, 3, 0])", "torch.tensor([1, 1, 3, 3])"))
    with pytest.raises(LayoutError, match=r"computes a value over the rows of the batch that data-dependent code "
                                          r"reads"):
        compile_program(tmp_path / "mixed.py", Layout(dp=2))


MEAN_OF_SELECTION = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x, mask):
        return self.head(x).squeeze(-1).masked_select(mask).square().mean()


def make_model():
    return Model()


def make_inputs():
    return {"x": torch.randn(4, 4), "mask": torch.tensor([True, False, True, True])}
"""


def test_a_mean_over_a_masked_selection_is_not_averaged_over_the_parts(tmp_path):
    # parts selecting 1 and 2 elements: the mean of the parts' means weighs them 1:1, one device 1:2; the selection
    # feeds no CTC loss, so it is computed whole, where its size the data decides is refused
    from fxshard.compiler import compile_program
    from fxshard.ir.context import Layout

    (tmp_path / "sel.py").write_text(MEAN_OF_SELECTION)
    with pytest.raises(LayoutError, match=r"model: masked_select \(aten.masked_select.default, sel.py:\d+\) is "
                                          r"computed on the whole batch under --dp 2 and fails at its size"):
        compile_program(tmp_path / "sel.py", Layout(dp=2))


def test_a_table_tiled_across_the_rows_is_found_beside_an_input_of_one_row():
    """The rows are counted on an input the batch splits, not the first input (a ``position_ids`` of ``[1, S]``
    counted one row, and every repeat count was a multiple of it)."""
    class Tiled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, H))

        def forward(self, pos, h):
            slots = self.w.repeat(3 * h.shape[0] // 2, 1).view(h.shape[0], 3, H)  # odd rows start at w[1]
            return (h + slots[:, :1] + pos.unsqueeze(-1)).mean()

    def inputs(b):
        return torch.arange(S).unsqueeze(0).float(), torch.randn(b, S, H)

    one, two = (export(Tiled(), inputs(b), strict=False) for b in (B, 2 * B))
    users = {s.arg.name for s in one.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    rows = batch_rows(one.graph_module, two.graph_module, users, "model.py")
    assert any("aten.repeat.default" in f and "mixes the rows of the batch" in f for f in rows.mixing.values()), \
        rows.mixing
