"""Tier 2: every sharding rule, over its op's argument variants, computes what the unsharded op computes.

Each case is one op (a few ops where the rule needs a partial sum before it) on tensors placed as the case
says.  It is captured like a model (``capture``), compiled through the compiler's own passes with the
tensor-parallel pass's placements replaced by the case's (propagation, rewrites and localized shapes are the
production ones: :func:`~fxshard.passes.tensor_parallel.apply_propagation`), generated as rank files, and run
on a real gloo group (``make test``; in ``make test-fast``, one thread per rank in this process, with the same
runtime collectives over a threaded transport: ``threaded_group.py``): outputs, input gradients and inputs written in
place are reassembled from the ranks and compared with the op on one device, fp32, within ``single_op.TOL``: relative
1e-6 plus absolute 1e-5 on values of order 1 (a split only reorders sums; a wrong split is off by order 1).  The cases
are in ``sharding_cases.py``: all of them share one spawned group of 2 processes, a few another of 4.

Each case also states what the rule must decide: ``split`` (the op computes on split or partial inputs, no
fallback), ``declined`` (the rule refuses an argument it cannot honor: the inputs are gathered and the compile
notes it), ``whole`` (a partial input is reduced first, no fallback), or ``refused`` (a ShardingError).
"""

from __future__ import annotations

import os

import pytest
import threaded_group
from sharding_cases import CASES, CASES_4, Case
from single_op import check_case, compile_case, run_rank, run_thread

from fxshard.errors import ShardingError
from fxshard.testing import case_result, spawn_cases


def _compile_all(cases: list[Case], tp: int):
    compiled, errors = {}, {}
    for case in cases:
        try:
            compiled[case.key] = compile_case(case, tp)
        except Exception as e:  # failed here, the case fails alone
            errors[case.key] = e
    items = [(k, (c.sources, c.states, c.batch, c.cotangents)) for k, c in compiled.items()]
    if os.environ.get("FXSHARD_TEST_FAST") == "1":  # the edit loop: the ranks as threads of this process
        return compiled, errors, threaded_group.run_cases(run_thread, tp, items)
    return compiled, errors, spawn_cases(run_rank, tp, items) if items else {}


@pytest.fixture(scope="module")
def world2():
    return _compile_all(CASES, 2)


@pytest.fixture(scope="module")
def world4():
    return _compile_all(CASES_4, 4)


def _check(case: Case, found) -> None:
    compiled, errors, results = found
    if case.expect == "refused":
        assert isinstance(errors.get(case.key), ShardingError), f"{case.key}: expected a ShardingError"
        return
    if case.key in errors:
        raise errors[case.key]
    check_case(case, compiled[case.key], case_result(results, case.key))


@pytest.mark.parametrize("case", CASES, ids=[c.key for c in CASES])
def test_rule_matches_the_unsharded_op(case, world2):
    _check(case, world2)


@pytest.mark.parametrize("case", CASES_4, ids=[c.key for c in CASES_4])
def test_rule_matches_the_unsharded_op_at_tp4(case, world4):
    _check(case, world4)
