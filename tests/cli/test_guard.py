"""Tier 3: a rank file that skips a collective fails the run within the timeout, naming the rank and the
collective, instead of hanging (``fxshard.runtime.guard``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fxshard.driver import compile
from fxshard.ir.context import Layout
from fxshard.testing import cli

ROOT = Path(__file__).resolve().parents[2]


def _skip_an_all_reduce(out: Path) -> None:
    path = out / "rank_pp0_tp1.py"
    text = path.read_text()
    assert text.count("all_reduce = rt.all_reduce(embedding, self.tp)") == 1  # the vocab-parallel embedding's
    path.write_text(text.replace("all_reduce = rt.all_reduce(embedding, self.tp)", "all_reduce = embedding"))


def _line(path, start: str) -> int:
    """The line number of the one line of ``path`` that starts (after indentation) with ``start``."""
    (number,) = [i for i, x in enumerate(path.read_text().splitlines(), 1) if x.strip().startswith(start)]
    return number


@pytest.mark.e2e
def test_run_refuses_a_rank_file_that_would_hang_before_launching(tmp_path):
    out = tmp_path / "out"
    compile(ROOT / "samples" / "gpt.py", Layout(tp=2), out=out)
    _skip_an_all_reduce(out)
    # --allow-edited: without it the edit is refused by its digest, before the static check this test is about
    proc = cli("run", out, "--steps", 1, "--allow-edited", timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: rank_pp0_tp1.py:" in proc.stderr and "running this would hang" in proc.stderr
    assert "launching" not in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.e2e
@pytest.mark.distributed
def test_rank_that_skips_an_all_reduce_fails_fast_naming_rank_and_collective(tmp_path):
    out = tmp_path / "out"
    compile(ROOT / "samples" / "gpt.py", Layout(tp=2), out=out)
    _skip_an_all_reduce(out)
    # rank 1 now issues 16 forward all-reduces to rank 0's 17: the first 16 pair up (same shapes, wrong sums),
    # then rank 0 waits in its 17th all-reduce (the last block's MLP) while rank 1 waits in the cross entropy's
    # all-gather
    line0 = _line(out / "rank_pp0_tp0.py", "all_reduce_1 = rt.all_reduce(")
    line1 = _line(out / "rank_pp0_tp1.py", "all_gather = rt.all_gather(vocab_cross_entropy_parts,")
    start = time.monotonic()
    # `fxshard run` refuses such a folder before launching (next test); --no-check --allow-edited launches it
    # anyway (without --allow-edited the edit is refused by its digest), so the run-time guard is what stops it
    proc = cli("run", out, "--steps", 1, "--timeout", 10, "--no-check", "--allow-edited", timeout=300, cwd=ROOT)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert elapsed < 150, f"took {elapsed:.0f} s with a 10 s collective timeout"
    summary = proc.stderr[proc.stderr.index("error: distributed run failed:"):]
    # whichever rank gives up first is named with its collective, the line that issued it and its number
    # (the other may be stopped by the launcher before its own timeout)
    named = {
        0: f"rank 0 exited with code 2: CollectiveError: rank 0: all_reduce float32 [8, 16, 64] "
           f"(rank_pp0_tp0.py:{line0}, "
           "collective #17 over this group in training step 1) over process group ranks [0, 1] did not complete",
        1: f"rank 1 exited with code 2: CollectiveError: rank 1: all_gather float32 [128, 1, 2] "
           f"(rank_pp0_tp1.py:{line1}, "
           "collective #17 over this group in training step 1) over process group ranks [0, 1] did not complete",
    }
    assert any(text in summary for text in named.values()), summary
    assert "`fxshard check OUT` names the line where" in summary
    assert "(training step 1) is alive but not in this collective" in summary  # its heartbeat: not a stopped peer
    assert "Traceback" not in proc.stderr
