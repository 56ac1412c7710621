"""Golden rank files: the code fxshard generates for a sample, byte for byte.

A change to the generated code shows here as a diff a reviewer can read.  After a deliberate change,
regenerate with ``FXSHARD_REGOLD=1 .venv/bin/python -m pytest tests/test_golden.py`` and commit the files.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "fixtures" / "generated"
CASES = {  # golden file -> (model file, layout, rank file)
    "gpt_tp2_rank_pp0_tp1.py": ("samples/gpt.py", Layout(tp=2), "rank_pp0_tp1.py"),
    "llama_tp2_pp2_rank_pp1_tp0.py": ("samples/llama.py", Layout(tp=2, pp=2), "rank_pp1_tp0.py"),
}


@pytest.mark.parametrize("golden", list(CASES))
def test_generated_code_matches_the_golden_file(golden):
    model, layout, rank = CASES[golden]
    source = compile_model(ROOT / model, layout).sources[rank]
    path = GOLDEN / golden
    if os.environ.get("FXSHARD_REGOLD") == "1":
        path.write_text(source)
    want = path.read_text()
    if source != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), source.splitlines(True), str(path),
                                            "generated", n=2))
        pytest.fail(f"the generated code differs from {path.name} (regenerate with FXSHARD_REGOLD=1 if deliberate):\n"
                    + diff[:4000])
