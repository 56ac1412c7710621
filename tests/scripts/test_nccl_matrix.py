"""scripts/nccl_matrix.py reads each case's agreement from `fxshard verify`'s summary as rich prints it (wrapped at
120 columns), tells a pass from a failure, a crash and a time-out, and runs the --cp cases now that Layout has cp."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from fxshard.ir.context import Layout

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nccl_matrix.py"
spec = importlib.util.spec_from_file_location("nccl_matrix", SCRIPT)
matrix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(matrix)

PRINTED = """tp=2 pp=1 dp=1 zero=0: losses max abs 0.000e+00 rel 0.000e+00; parameters max abs 3.815e-06,
||diff|| / ||update|| 4.647e-05 (most: model.layers.0.mlp.down_proj.weight); tolerance: losses 1e-05 relative,
parameters 0.001 of the update: OK"""


def test_the_wrapped_summary_is_read_and_a_pass_needs_exit_0_and_ok():
    found = matrix.SUMMARY.search(" ".join(PRINTED.split()))
    assert found.groups() == ("0.000e+00", "0.000e+00", "3.815e-06", "4.647e-05", "model.layers.0.mlp.down_proj.weight",
                              "1e-05", "0.001", "OK")
    assert matrix.status({"exit": 0, "verdict": "OK"}) == "pass"
    assert matrix.status({"exit": 1, "verdict": "FAILED"}) == "FAILED"
    assert matrix.status({"exit": 2}) == "error (exit 2)"
    assert matrix.status({"exit": None}) == "timed out"


def test_the_cp_cases_are_built_and_name_each_mode():
    assert "cp" in {f.name for f in dataclasses.fields(Layout)}
    assert all(matrix.built(c) for c in ("llama-cp2", "llama-cp2-ring", "llama-cp2-tp2-a2a", "llama-tp2"))
    assert matrix.CASES["llama-cp2"][1] == ["--cp", "2"]
    assert matrix.CASES["llama-cp2-ring"][1][-2:] == ["--cp-mode", "ring"]
    for case in ("llama-cp2", "llama-cp2-ring", "llama-cp2-tp2-a2a"):  # flags verify takes, into a valid Layout
        flags = matrix.CASES[case][1]
        kw = {flags[i].removeprefix("--").replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
        Layout(**{k: int(v) if v.isdigit() else v for k, v in kw.items()})
