"""``fxshard ARGS`` run in the test's own process, read as a test reads a subprocess of it.

A subprocess pays a torch import and a fresh start (seconds each); this runs the same typer application (the
real commands, their option checks and the library behind them) through typer's ``CliRunner`` and returns
what a subprocess would show: the exit status, stdout and stderr. Warnings are shown as a fresh interpreter
shows them (Python's default filters, fxshard's one-line ``warning:``), and an exception that escapes a command
is a traceback on stderr with status 1, as the interpreter would print it::

    done = fxshard("compile", "samples/gpt.py", "--tp", "2", "--out", tmp_path / "gpt")
    assert done.returncode == 0, done.stderr

Tests that need a real process keep ``subprocess``: ones that send signals, kill or time a process, measure its
memory, or train (``fxshard run`` starting its workers: those are marked ``e2e``).
"""

from __future__ import annotations

import os
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner


@dataclass
class Completed:
    """What ``subprocess.run(..., capture_output=True, text=True)`` returns, for the fields tests read."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


@contextmanager
def _cwd(folder):
    if folder is None:
        yield
        return
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextmanager
def _fresh_warnings(show):
    """The warning filters of a fresh interpreter (see ``warnings``'s documentation), and the CLI's display."""
    with warnings.catch_warnings():  # also forgets which warnings were shown already: each run shows them again
        warnings.resetwarnings()
        warnings.simplefilter("ignore", ResourceWarning)
        warnings.simplefilter("ignore", ImportWarning)
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        warnings.showwarning = show
        yield


def fxshard(*args, env: dict[str, str | None] | None = None, cwd: str | Path | None = None) -> Completed:
    """Run ``fxshard *args`` here.  ``env``: variables to set (``None`` removes one) while it runs."""
    from fxshard.cli import app as cli

    argv = [str(a) for a in args]
    with _cwd(cwd), _fresh_warnings(cli._show_warning):
        result = CliRunner().invoke(cli.app, argv, env=env, prog_name="fxshard")
    stderr, status = result.stderr, result.exit_code
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        error = result.exception
        stderr += "Traceback (most recent call last):\n" + "".join(
            traceback.format_exception(type(error), error, error.__traceback__)[1:])
        status = 1
    return Completed(["fxshard", *argv], status, result.stdout, stderr)
