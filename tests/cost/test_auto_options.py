"""Tier 1: AutoOptions checks itself: a flag only the search reads, given without --auto, is refused naming it."""

from __future__ import annotations

import pytest

from fxshard.cost.auto_options import AutoOptions
from fxshard.errors import OptionError


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"gpus": 4}, "--gpus is for --auto"),
    ({"gpus_per_node": 8}, "--gpus-per-node places the mesh on nodes for the time model: expected --hardware too"),
    ({"auto": True, "gpus": 0}, "--gpus must be at least 1, got 0"),
    ({"auto": True, "gpus": 8, "top": 0}, "--top must be at least 1, got 0"),
])
def test_bad_options_are_refused_naming_the_flag(kwargs, says):
    with pytest.raises(OptionError, match=says):
        AutoOptions(**kwargs)


def test_plan_predicts_with_hardware_alone_and_compile_refuses_what_only_the_search_reads():
    options = AutoOptions(hardware="h100", gpus_per_node=8)  # fxshard plan --hardware: a prediction, no search
    with pytest.raises(OptionError, match=r"^--hardware without --auto: compile reads it only to search"):
        options.check_compile()
    AutoOptions(auto=True, gpus=8, hardware="h100").check_compile()  # the search's
    AutoOptions().check_compile()
