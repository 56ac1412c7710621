"""``fxshard --version`` and the note on a torch the tests do not run on."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from cli.app import app
from fxshard.tools import environment


def test_version_names_fxshard_torch_and_its_backends():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert f"torch {torch.__version__} (" in result.output and "gloo available" in result.output
    assert environment.untested_torch() is None  # the suite runs on the tested release


def test_another_torch_is_noted_with_the_declared_range(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.15.1+cu128")
    note = environment.untested_torch()
    assert note.startswith("torch 2.15.1+cu128 is accepted (") and "tests run on torch 2.13" in note
    assert "<2.16" in note and ">=2.13" in note  # the range pyproject.toml declares, read from the installed package
