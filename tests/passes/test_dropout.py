"""Tier 1: the dropout pass — sites, per-rank slices, generated lines, and the dropouts it refuses."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from fxshard.compiler import compile_program
from fxshard.driver import compile as compile_model
from fxshard.errors import RandomnessError
from fxshard.ir.context import Layout
from fxshard.runtime import draws as rt_draws
from fxshard.runtime import random as rt_random

aten = torch.ops.aten

_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
{body}
        return h.pow(2).mean()


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 6, 8),)
'''


def _model_file(tmp_path, body: str):
    path = tmp_path / "model.py"
    path.write_text(_MODEL.format(body=textwrap.indent(textwrap.dedent(body).strip(), " " * 8)))
    return path


def _dropouts(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is rt_random.dropout]


def test_sites_number_training_calls_in_order_and_off_calls_disappear(tmp_path):
    path = _model_file(tmp_path, """
        h = F.dropout(h, 0.1)
        h = F.dropout(h, 0.5, training=False)
        h = F.dropout(h, 0.0)
        h = F.dropout(h, 0.2)
    """)
    gm = compile_program(path, Layout()).gm
    found = [(n.args[1], n.kwargs["site"]) for n in _dropouts(gm)]
    assert found == [(0.1, 0), (0.2, 2)]  # p=0 keeps its site (the reference counts it too), emits nothing
    assert not [n for n in gm.graph.nodes if "dropout" in str(n.target) and n.target is not rt_random.dropout]


def test_generated_lines_pass_each_tp_rank_its_slice(models):
    result = compile_model(models / "gpt2_dropout.py", Layout(tp=2))
    lines = {r: [ln.strip() for ln in result.sources[f"rank_pp0_tp{r}.py"].splitlines() if "rt.dropout(" in ln]
             for r in (0, 1)}
    assert len(lines[0]) == 13  # embedding; per layer: attention probabilities, residual, MLP
    sites = [int(re.search(r"site=(\d+)", ln).group(1)) for ln in lines[0]]
    assert sorted(sites) == list(range(13))  # block classes come first in the file
    attn = [ln for ln in lines[1] if "shard=" in ln]
    assert len(attn) == 4 and all("shard=(1, 1, 2))" in ln
                                  and "f32 S(1)  layout-invariant mask" in ln for ln in attn), attn
    assert all("shard=(1, 0, 2))" in ln for ln in lines[0] if "shard=" in ln)
    assert ("dropout = rt.dropout(add_1, 0.1, site=0);  add_1 = None  # [4, 16, 64] f32 layout-invariant mask, as on "
            "one device") in lines[0]


def test_sdpa_dropout_is_refused_with_the_module_named(tmp_path):
    path = _model_file(tmp_path, """
        q = h.view(4, 6, 2, 4).transpose(1, 2)
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).transpose(1, 2).reshape(4, 6, 8)
    """)
    with pytest.raises(RandomnessError, match=r"model: .*dropout_p=0.1.*attn_implementation=\"eager\""):
        compile_program(path, Layout())


def test_sdpa_without_dropout_compiles(tmp_path):
    path = _model_file(tmp_path, """
        q = h.view(4, 6, 2, 4).transpose(1, 2)
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0).transpose(1, 2).reshape(4, 6, 8)
    """)
    compile_program(path, Layout())


@pytest.mark.parametrize("call", ["F.dropout1d(h, 0.1, True)", "F.dropout2d(h.unsqueeze(-1), 0.1, True).squeeze(-1)",
                                  "F.alpha_dropout(h, 0.1, True)", "F.feature_alpha_dropout(h, 0.1, True)"])
def test_other_dropout_variants_are_refused(tmp_path, call):
    path = _model_file(tmp_path, f"h = {call}")
    with pytest.raises(RandomnessError, match="use nn.Dropout / F.dropout"):
        compile_program(path, Layout())


def test_a_dropout_input_without_leading_batch_is_refused_when_the_batch_is_split(tmp_path):
    path = _model_file(tmp_path, "h = F.dropout(h.transpose(0, 1), 0.1).transpose(0, 1)")
    compile_program(path, Layout())  # one rank sees the whole batch: any layout of the input is fine
    with pytest.raises(RandomnessError, match=r"dim 0 must be the batch \(size 2\), found 6"):
        compile_program(path, Layout(dp=2))


@pytest.mark.parametrize("layout", [Layout(dp=2), Layout(dp=2, tp=2)], ids=["dp2", "dp2-tp2"])
def test_other_random_ops_draw_their_rows_of_one_devices_values(tmp_path, layout):
    # numbered among themselves in graph order; the rows: 2 of the batch of 4, in 2 parts (the dp ranks)
    path = _model_file(tmp_path, "h = h + torch.randn_like(h) + torch.rand(h.shape[0], 1, 1) + torch.rand(8)")
    draws = [n for n in compile_program(path, layout).gm.graph.nodes if n.target is rt_draws.draw]
    assert [(n.args[0], n.kwargs["site"], n.kwargs.get("rows")) for n in draws] == [
        (aten.randn_like.default, 0, (0, 2, 2)), (aten.rand.default, 1, (0, 2, 2)), (aten.rand.default, 2, None)]


def test_a_draw_split_along_the_sequence_under_cp_is_refused(tmp_path):
    path = _model_file(tmp_path, "h = h + torch.randn_like(h)")
    with pytest.raises(RandomnessError, match=r"randn_like.* split along the sequence under --cp 2"):
        compile_program(path, Layout(cp=2))


@pytest.mark.parametrize("call", ["F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)",
                                  "F.scaled_dot_product_attention(q, q, q)"])
def test_attention_without_dropout_draws_nothing_and_is_not_noted(tmp_path, call):
    # torch tags the op random, not the call: dropout_p=0 (every SDPA model without attention dropout) never draws
    path = _model_file(tmp_path, f"""
        q = h.view(4, 6, 2, 4).transpose(1, 2)
        h = {call}.transpose(1, 2).reshape(4, 6, 8)
    """)
    ctx = compile_program(path, Layout(tp=2)).ctx
    assert not [note for note in ctx.notes if "generator" in note], ctx.notes


@pytest.mark.parametrize("training", [True, False])
def test_a_random_op_is_refused_only_when_the_call_draws(tmp_path, training):
    path = _model_file(tmp_path, f"h = F.rrelu(h, training={training})")
    if training:
        with pytest.raises(RandomnessError, match="rrelu.* draws random numbers in training"):
            compile_program(path, Layout(dp=2))
    else:
        compile_program(path, Layout(dp=2))


def test_in_place_dropout_keeps_its_input(tmp_path):
    # nn.Dropout(inplace=True) captures as aten.dropout_, whose tensor argument is `self`, not `input`: at p = 0
    # the op was replaced by None (MobileNetV2's classifier crashed the compile at tp=2), at p > 0 it dropped None
    path = _model_file(tmp_path, """
        h = F.dropout(h, 0.0, inplace=True)
        h = F.dropout(h, 0.3, inplace=True)
    """)
    gm = compile_program(path, Layout()).gm
    (site,) = _dropouts(gm)
    assert site.args[0].target is aten.linear.default and site.kwargs["inplace"] is True
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.dropout_.default]
