"""Tier 1: the examples in fxshard's docstrings run and print what they say.

A ``>>>`` example is a claim about the code (``KINDS["fp8_linears_regathered"].ops("backward")``, a recipe's amax
count); one that no longer holds is a doc that drifted.  Every module of ``fxshard`` and ``passes`` with such an
example runs here under :mod:`doctest` (an example that needs a model, a process group or a GPU is written as a
``::`` block instead, which this does not run), in a scratch folder holding ``samples/``.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> list[str]:
    found = []
    for package, folder in (("fxshard", ROOT / "fxshard"), ("fxshard.passes", ROOT / "passes")):
        for path in sorted(folder.rglob("*.py")):
            if ">>>" not in path.read_text():
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found.append(".".join((package, *parts)))
    return found


MODULES = _modules()


def test_the_modules_with_examples_are_found():
    assert {"fxshard.ir.comm", "fxshard.runtime.fp8", "fxshard.cost.timemodel"} <= set(MODULES)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory holding ``samples/``, as the repository's root does: an example that writes
    (``fxshard.compile("samples/gpt.py", "out/gpt-tp2", ...)``) writes here."""
    (tmp_path / "samples").symlink_to(ROOT / "samples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", MODULES)
def test_each_docstring_example_prints_what_it_says(name, scratch):
    import fxshard

    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    failed = [t.name for t in doctest.DocTestFinder().find(module, name, extraglobs={"fxshard": fxshard})
              if runner.run(t, out=report.append).failed]
    assert not failed, f"{name}: the examples of {', '.join(failed)} fail:\n" + "".join(report)
