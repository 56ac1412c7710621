"""benchmarks/auto_recipes.py compares like with like: an FP8 run is predicted in fp8, every figure cites its
publication at a commit, and the compute split it prints adds up to the time model's compute term."""

from __future__ import annotations

import re

import pytest

from benchmarks.auto_recipes import compute_split
from benchmarks.recipes import RECIPES, Recipe
from fxshard.cost.hardware import load_hardware
from fxshard.cost.timemodel import Evaluator, Setting, predict
from fxshard.ir.layout import Layout


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_each_recipe_is_predicted_in_its_own_precision_and_cites_a_commit(recipe):
    """Megatron-Bridge's rows are FP8 current-scaling runs, torchtitan's 70B Float8: their precision is fp8, which
    auto_recipes predicts with an fp8 evaluator; a BF16 run stays bf16."""
    fp8 = "FP8" in recipe.recipe or "Float8" in recipe.recipe
    assert recipe.precision == ("fp8" if fp8 else "bf16")
    assert re.search(r"\b[0-9a-f]{8,40}\b", recipe.source), recipe.source


@pytest.fixture(scope="module")
def profile(llama_bf16_profile):
    return llama_bf16_profile


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_compute_split_adds_up_to_the_compute_term(profile, dtype):
    """matmul + attention + other ops is the predicted step's compute term (one pp rank: it is the busiest)."""
    recipe = Recipe("x", "samples/llama.py", 2, 64, 8, Layout(dp=2, dtype="bf16"), dtype, 1.0, None, "", "", "")
    ev = Evaluator(profile, load_hardware("h100"), dtype)
    pred = predict(ev, recipe.layout, Setting(recipe.seq, recipe.global_batch, 8))
    split = compute_split(ev, recipe.layout, recipe)
    assert all(v > 0 for v in split.values())
    assert sum(split.values()) == pytest.approx(pred.terms["compute"])
