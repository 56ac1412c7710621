"""Automatic pairing completes a model's own partial plan (issue 31): the shipped entries win where they speak, the
modules they leave out are paired, and a plan the user gives is used as it is.  Bamba, Falcon-H1 and Jamba ship
partial plans (the embedding only, the experts only); completed, each tp=2 rank holds at most 55% of the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.compiler import compile_program
from fxshard.cost.costs import plan_costs
from fxshard.driver import verify
from fxshard.ir.layout import Layout
from fxshard.testing import matrix

ROOT = Path(__file__).resolve().parent.parent.parent
PARTIAL = ROOT / "tests" / "models" / "partial_plan.py"


def test_pairing_completes_a_shipped_plan_where_it_is_silent():
    plan = compile_program(PARTIAL, Layout(tp=2)).ctx.plan
    assert plan.source == "model+auto"
    assert plan.describe() == [
        "mlp_a.fc_in: replicate()  [model]",  # its pair with fc_out is not made: fc_out stays whole
        "mlp_b.fc_in: colwise()  [model]",
        "mlp_b.fc_out: rowwise()  [model]",
        "mlp_c.fc_in: colwise()  [auto]",
        "mlp_c.fc_out: rowwise()  [auto]",
    ]


def test_a_users_plan_gets_no_pairing_and_the_not_split_list_says_why():
    plan = {"mlp_b.fc_in": "colwise", "mlp_b.fc_out": "rowwise"}
    report = plan_costs(PARTIAL, Layout(tp=2), plan=plan).to_json()["unsplit"]
    reasons = {(m["modules"], m["reason"]) for m in report["modules"]}
    assert ("mlp_c.fc_in", "no rule: the user plan does not name it (a plan given by --plan or decorators is used as "
            "it is, without automatic pairing; name the module in it)") in reasons
    shipped = {(m["modules"], m["reason"]) for m in plan_costs(PARTIAL, Layout(tp=2)).to_json()["unsplit"]["modules"]}
    assert ("mlp_a.fc_out", "no rule: the model's own plan does not name it and automatic pairing found no column/row "
            "pair within its module that splits without a gather inside it") in shipped
    assert ("mlp_a.fc_in", "the plan replicates it") in shipped


@pytest.mark.slow  # a search over every split of a transformers hybrid: 4-7 s alone
@pytest.mark.parametrize("model", matrix(["falcon_h1", "bamba", "jamba"], keep=["falcon_h1"]))
def test_hybrids_with_partial_shipped_plans_split_to_at_most_55_percent(model):
    report = plan_costs(ROOT / "zoo" / "models" / f"{model}.py", Layout(tp=2)).to_json()["unsplit"]
    assert report["whole_share"] < 0.1, report["modules"]
    assert not report["over_threshold"]


@pytest.mark.distributed
def test_a_completed_plan_trains_like_one_device():
    result = verify(PARTIAL, Layout(tp=2), steps=3)
    assert result.ok, result.summary()


# Attention whose pairs propagation used to drop (issue 31 item 4), split by heads now:
# - DeepSeek-V3's MLA: the greedy choice took the inner pairs (q_a_proj -> q_b_proj through a norm over the whole
#   latent; kv_a_proj_with_mqa -> kv_b_proj), which need a gather, and dropped o_proj whose columns they had made rows;
#   the outer retry pairs o_proj with q_b_proj and kv_b_proj, the latents whole (as Megatron-Core splits MLA), and the
#   keys' new_empty buffer filled by copy_ is split like the heads;
# - GPT-OSS: the sinks (one logit per head, whole) concatenated beside the split scores, and a max along the keys.
def test_deepseek_v3_mla_splits_by_heads_with_the_latents_whole():
    ctx = compile_program(ROOT / "zoo" / "models" / "deepseek_v3.py", Layout(tp=2)).ctx
    styles = {fqn.split("self_attn.")[1]: str(st) for fqn, st in ctx.plan.styles.items()
              if fqn.startswith("model.layers.1.self_attn.")}
    assert styles == {"q_b_proj": "colwise()", "kv_b_proj": "colwise()", "o_proj": "rowwise()"}, styles
    assert not any("self_attn" in n and "all-gathered first" in n for n in ctx.notes), ctx.notes


def test_gpt_oss_attention_splits_by_heads():
    ctx = compile_program(ROOT / "tests" / "models" / "hf_gpt_oss.py", Layout(tp=2)).ctx
    styles = {fqn.split("self_attn.")[1]: str(st) for fqn, st in ctx.plan.styles.items()
              if fqn.startswith("model.layers.0.self_attn.")}
    assert styles == {"q_proj": "colwise()", "k_proj": "colwise()", "v_proj": "colwise()", "o_proj": "rowwise()"}
    assert not any("self_attn" in n and "all-gathered first" in n for n in ctx.notes), ctx.notes


@pytest.mark.distributed
def test_gpt_oss_attention_split_by_heads_trains_like_one_device():
    result = verify(ROOT / "tests" / "models" / "hf_gpt_oss.py", Layout(tp=2), steps=3)
    assert result.ok, result.summary()
