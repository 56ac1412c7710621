"""Tier 1: --seq and --batch are declared once (StepShape); --global-batch, the old name of --batch under --auto, still
parses, hidden, and says it is deprecated."""

from __future__ import annotations

import pytest

from fxshard.errors import FxshardWarning, OptionError
from fxshard.step_shape import StepShape, flags


def test_global_batch_is_the_old_name_of_batch_and_says_so():
    with pytest.warns(FxshardWarning, match=r"--global-batch is deprecated: it is --batch .*; use --batch"):
        shape = StepShape(seq=16, global_batch=8)
    assert shape == StepShape(seq=16, batch=8)  # one name from here on
    with pytest.warns(FxshardWarning):
        assert StepShape(batch=8, global_batch=8).batch == 8


def test_the_old_name_is_hidden_and_the_new_one_says_what_it_counts():
    declared = {f.name: f for f in flags(StepShape)}
    assert declared["global_batch"].hidden and not declared["batch"].hidden and not declared["seq"].hidden
    assert "over all dp ranks" in declared["batch"].help


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"batch": 4, "global_batch": 8}, "--global-batch 8 and --batch 4: --global-batch is the old name of --batch"),
    ({"batch": 0}, "--batch must be at least 1, got 0"),
    ({"seq": -1}, "--seq must be at least 1, got -1"),
])
def test_bad_shapes_are_refused_naming_the_flag(kwargs, says):
    with pytest.raises(OptionError, match=says):
        StepShape(**kwargs)
