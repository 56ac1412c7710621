"""A rank file runs with torch and ``fxshard.runtime`` alone: importing the runtime loads nothing of the
compiler (capture, plans, passes) and registers no torch.library op as a side effect.  Nor does it load
``torch.distributed.pipelining``, which only pipeline runs use (imported where used)."""

import subprocess
import sys

PROBE = """
import sys
LATER = {LATER!r}
import fxshard.runtime
import torch
loaded = sorted(m for m in sys.modules if m == "fxshard" or m.startswith("fxshard."))
print(",".join(loaded))
print(hasattr(torch.ops.fxshard, "pipeline_split"))
print(",".join(m for m in LATER if m in sys.modules) or "-")
"""
LATER = ("torch.distributed.pipelining",)


def test_runtime_imports_no_compiler_module():
    out = subprocess.run([sys.executable, "-c", PROBE.format(LATER=LATER)], capture_output=True, text=True, check=True).stdout.split()
    loaded = out[0].split(",")
    outside = [m for m in loaded if m not in ("fxshard", "fxshard.errors", "fxshard.version") and not m.startswith("fxshard.runtime")]
    assert outside == [], f"importing fxshard.runtime loaded compiler modules: {outside}"
    assert out[1] == "False", "importing fxshard.runtime registered torch.ops.fxshard.pipeline_split"
    assert out[2] == "-", f"importing fxshard.runtime loaded {out[2]}: import it where it is used"


def test_public_names_load_on_first_use():
    probe = "import fxshard; print(fxshard.colwise().kind, callable(fxshard.pipeline_split), fxshard.FxshardError.__name__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["colwise", "True", "FxshardError"]
