"""scripts/nccl_matrix.py reads each case's agreement from `fxshard verify`'s summary as rich prints it (wrapped at
120 columns), tells a pass from a failure, a crash and a time-out, and keeps the --cp slot until Layout has cp."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from fxshard.ir.context import Layout

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nccl_matrix.py"
spec = importlib.util.spec_from_file_location("nccl_matrix", SCRIPT)
matrix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(matrix)

PRINTED = """tp=2 pp=1 dp=1 zero=0: losses max abs 0.000e+00 rel 0.000e+00; parameters max abs 3.815e-06, ||diff|| / ||update||
4.647e-05 (most: model.layers.0.mlp.down_proj.weight); tolerance: losses 1e-05 relative, parameters 0.001 of the
update: OK"""


def test_the_wrapped_summary_is_read_and_a_pass_needs_exit_0_and_ok():
    found = matrix.SUMMARY.search(" ".join(PRINTED.split()))
    assert found.groups() == ("0.000e+00", "0.000e+00", "3.815e-06", "4.647e-05", "model.layers.0.mlp.down_proj.weight",
                              "1e-05", "0.001", "OK")
    assert matrix.status({"exit": 0, "verdict": "OK"}) == "pass"
    assert matrix.status({"exit": 1, "verdict": "FAILED"}) == "FAILED"
    assert matrix.status({"exit": 2}) == "error (exit 2)"
    assert matrix.status({"exit": None}) == "timed out"


def test_the_cp_slot_waits_for_a_layout_field():
    has_cp = "cp" in {f.name for f in dataclasses.fields(Layout)}
    assert matrix.built("llama-cp2") == has_cp and matrix.built("llama-tp2")
    assert matrix.CASES["llama-cp2"][1] == ["--cp", "2"]
