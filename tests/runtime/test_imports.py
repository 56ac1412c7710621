"""A rank file runs with torch and ``fxshard.runtime`` alone: importing the runtime loads nothing of the
compiler (capture, plans, passes) and registers no torch.library op as a side effect; the package's public names
load the compiler on first use.  One fresh interpreter probes both, in that order (torch imports once)."""

import subprocess
import sys

import pytest

PROBE = """
import sys
import fxshard.runtime
import torch
loaded = sorted(m for m in sys.modules if m == "fxshard" or m.startswith("fxshard."))
print(",".join(loaded))
print(hasattr(torch.ops.fxshard, "pipeline_split"))
import fxshard
print(fxshard.colwise().kind, callable(fxshard.pipeline_split), fxshard.FxshardError.__name__)
"""


@pytest.fixture(scope="module")
def probed() -> list[str]:
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.splitlines()


def test_runtime_imports_no_compiler_module(probed):
    loaded = probed[0].split(",")
    outside = [m for m in loaded if m not in ("fxshard", "fxshard.errors", "fxshard.version")
               and not m.startswith("fxshard.runtime")]
    assert outside == [], f"importing fxshard.runtime loaded compiler modules: {outside}"
    assert probed[1] == "False", "importing fxshard.runtime registered torch.ops.fxshard.pipeline_split"


def test_public_names_load_on_first_use(probed):
    assert probed[2].split() == ["colwise", "True", "FxshardError"]
