"""A rank that stops or never starts is named, with the phase or collective it left waiting, within the timeout.

Real processes and real signals: a worker SIGSTOPped under dp=2 ZeRO 3 (FSDP2's own collectives), tp=2
(fxshard's all-reduce) and pp=2 (the pipeline schedule's sends), and a rank 1 of 2 that never starts (rank 0
started by hand, as torchrun would).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout
from fxshard.testing import cli

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_supervision import _alive, _ranks  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "models" / "mlp.py"
GPT = Path(__file__).resolve().parents[2] / "samples" / "gpt.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_a_rank_that_never_starts_is_named_at_start_up(tmp_path):
    out = tmp_path / "o"
    compile_model(MLP, Layout(tp=2), out=out)
    env = os.environ | {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_port())}
    run = cli("run", out, "--steps", 1, "--timeout", 5, timeout=120, env=env)
    assert run.returncode == 2
    said = "rank 0: start-up: 1 of 2 ranks did not join the process group within --timeout 5 s"
    assert said in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.e2e
def test_a_rank_whose_rank_0_never_starts_names_it(tmp_path):
    out = tmp_path / "o"
    compile_model(MLP, Layout(tp=2), out=out)
    port = _port()
    env = os.environ | {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}
    run = cli("run", out, "--steps", 1, "--timeout", 5, timeout=120, env=env)
    assert run.returncode == 2
    assert (f"error: rank 1: start-up: rank 0, which hosts the store at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT), "
            "did not join the process group within --timeout 5 s") in run.stderr, run.stderr  # was 'some of the 2'
    assert "Traceback" not in run.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("model, layout, waiting", [
    pytest.param(MLP, Layout(dp=2, zero=3),
                 r"rank 0: FSDP2's parameter all-gathers and gradient reduce-scatters over dp \(ZeRO 3\) in training "
                 r"step \d+ ", marks=pytest.mark.matrix),
    # forward or backward, wherever the stop caught rank 1: the line and the collective's number (make
    # test-matrix's: pp2 below, and tests/cli/test_guard.py's tp all-reduce a rank skips, named with its line)
    pytest.param(MLP, Layout(tp=2),
                 r"rank 0: all_reduce (\(backward of copy_to(_linears, overlapped with the weight gradients)?\) )?"
                 r"float32 \[4, 16\] \(rank_pp0_tp0\.py:\d+, collective #\d+ over this group in training step "
                 r"\d+\)", marks=pytest.mark.matrix),
    # the schedule's sends and receives, or the step loss's broadcast from the last stage after them (the stop
    # caught rank 1 between its schedule and the broadcast)
    (GPT, Layout(pp=2), r"rank 0: (pipeline schedule Schedule1F1B \(send/recv of activations and gradients\) |"
                        r"broadcast of the step loss from the last pipeline stage )"
                        r"\(collective #\d+ over this group in training step \d+\)"),
    # ZeRO 1's bucket collectives are guarded like the rank files' (or the stop caught the step loss's all-reduce);
    # an all-gather left in flight by the step fails at its issue or where the next forward waits for it
    pytest.param(MLP, Layout(dp=2, zero=1),
                 r"rank 0: (reduce_scatter of a ZeRO-1 gradient bucket over dp float32 \[\d+\] |"
                 r"(the wait for the )?all_gather of ZeRO-1 parameter bucket \d+ over dp( \(issue\))? "
                 r"float32 \[\d+\] |"
                 r"all_reduce of the step loss over dp )\(collective #\d+ over this group in "
                 r"training step \d+\)", marks=pytest.mark.matrix),
    # --compile: the tp all-reduces run inside the graph, with no Python around them to name the line; the step
    # names what was in flight and the whole mesh's heartbeats name the stopped rank
    pytest.param(MLP, Layout(tp=2),
                 r"rank 0: the rank files' collectives over tp inside the torch.compile graphs \(--compile: run "
                 r"without it to have the failing one named with its line\) in training step \d+ "
                 r"over process group ranks \[0, 1\]", marks=pytest.mark.matrix),
], ids=["dp2-zero3", "tp2", "pp2", "dp2-zero1", "tp2-compile"])
def test_a_stopped_rank_is_named_with_the_collective_it_left_waiting(tmp_path, model, layout, waiting, request):
    # or the collectives every step issues at every layout, wherever the stop caught rank 1: the gradient norm read
    # before each update (for --on-nonfinite and --clip-grad-norm) over all ranks, the step loss over dp
    waiting = (rf"{waiting}|rank 0: all_reduce of the squared gradient norm \(read before every update\) "
               r"\(collective #\d+ over this group in training step \d+\) over process group ranks \[0, 1\]"
               r"|rank 0: all_reduce of the step loss over dp \(collective #\d+ over this group in training step \d+\)")
    out = tmp_path / "o"
    compile_model(model, layout, out=out)
    compiled = ["--compile"] if request.node.callspec.id.endswith("compile") else []
    proc = subprocess.Popen([sys.executable, "-m", "fxshard.cli.app", "run", str(out), "--steps", "100000",
                             "--timeout", "8", "--no-check", *compiled], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:
        if "step 2/" in line:
            break
    workers = _ranks(proc.pid)
    os.kill(workers[1], signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        for pid in workers.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 2, err
    assert re.search(waiting, err), err
    assert "rank 1 (last seen in " in err and "does not answer, its heartbeat stopped" in err, err
    assert "the rank files are not at fault" in err and "fxshard check" not in err  # the code was fine
    assert "rank 1 was stopped by the launcher (SIGTERM) because rank 0 failed" in err  # woken, not left 30 s
    assert "Traceback" not in err
