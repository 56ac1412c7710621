"""A signal that arrives during the swap but whose handler Python runs only after the swap's block (the kernel gave
it to another thread, which a loaded machine ran late: tests/cli/test_swap.py's SIGTERM to another thread failed so
once under make test, the compile saying the folder "was left as it was" after it had swapped) says what happened:
the folder holds the new program."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from fxshard.codegen.folder import PROGRAM
from fxshard.files import staged
from fxshard.files.staged import Interrupted, staged_output


def test_a_signal_handled_after_the_swap_says_the_new_program_is_in(tmp_path, monkeypatch):
    close = staged._Stage.close

    def close_then_the_late_handler(self):  # the last step inside the compile's signal handling, after the swap
        close(self)
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(staged._Stage, "close", close_then_the_late_handler)
    out = tmp_path / "o"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        with staged_output(out, {"a.txt"}, PROGRAM) as stage:
            Path(stage, "a.txt").write_text("new")
    assert stopped.value.swapped and (out / "a.txt").read_text() == "new"
    assert signal.getsignal(signal.SIGTERM) == before  # the compile's handlers put back
