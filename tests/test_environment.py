"""``fxshard --version``, the note on a torch the tests do not run on, and the range pyproject.toml declares."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from fxshard.cli.app import app
from typer.testing import CliRunner

from fxshard import environment

ROOT = Path(__file__).resolve().parents[1]


def test_version_names_fxshard_torch_and_its_backends():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert f"torch {torch.__version__} (" in result.output and "gloo available" in result.output
    assert environment.untested_torch() is None  # the suite runs on a tested release


def test_another_torch_is_noted_with_the_tested_releases_and_the_declared_range(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.15.1+cu128")
    note = environment.untested_torch()
    assert note.startswith("torch 2.15.1+cu128 is not among the releases fxshard's tests run on (torch 2.13 and "
                           "2.14; fxshard declares "), note
    assert environment._supported() in note  # the range the installed package declares
    monkeypatch.setattr(torch, "__version__", "2.14.1")
    assert environment.untested_torch() is None


def test_pyproject_admits_the_tested_releases_and_no_other():
    """The dependency's range is the tested minors: from the first to the one after the last."""
    declared = re.search(r'"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert declared, "pyproject.toml declares torch as >=A,<B"
    low, high = declared.groups()
    minor = int(environment.TESTED_TORCH[-1].split(".")[1])
    assert (low, high) == (environment.TESTED_TORCH[0], f"2.{minor + 1}")
    assert [int(m.split(".")[1]) for m in environment.TESTED_TORCH] == list(range(int(low.split(".")[1]), minor + 1))
