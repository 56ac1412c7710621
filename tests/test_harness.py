"""The shared-spawn harness reports each case on its own: a case that raises fails with its own traceback, and
the cases after it in the same process group say which case stopped them."""

import pytest

from fxshard.testing import CaseFailure, spawn_cases


def _case(value: int) -> int:
    import torch.distributed as dist

    if value < 0 and dist.get_rank() == 1:
        raise ValueError(f"bad case {value}")
    return value * 10 + dist.get_rank()


@pytest.mark.distributed
def test_one_bad_case_fails_alone_and_names_itself():
    found = spawn_cases(_case, 2, [("good", (1,)), ("bad", (-1,)), ("after", (2,))], timeout=120)
    assert found["good"] == [10, 11]
    assert isinstance(found["bad"], CaseFailure)
    assert "rank 1" in found["bad"].message and "ValueError: bad case -1" in found["bad"].message
    assert isinstance(found["after"], CaseFailure) and "'bad' failed before it" in found["after"].message


def test_spawn_refuses_an_unknown_backend_before_starting_a_process():
    from fxshard.testing import spawn

    with pytest.raises(ValueError, match="backend 'mpi': expected 'gloo' or 'nccl'"):
        spawn(_case, 2, 1, backend="mpi")


@pytest.mark.distributed
def test_nccl_without_a_gpu_fails_naming_the_rank():
    import torch

    from fxshard.testing import spawn

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the nccl backend would run")
    with pytest.raises(AssertionError,
                       match="(?s)rank 0 failed:.*rank 0: backend nccl needs a GPU and torch sees none"):
        spawn(_case, 2, 1, backend="nccl", timeout=60)


def _seen(rank: int, world: int) -> tuple:
    import os

    import torch

    return os.environ.get("FXSHARD_HARNESS_PROBE"), os.getcwd(), torch.get_num_threads(), os.getpid()


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_get_the_callers_environment_and_folder_at_the_call(method, monkeypatch, tmp_path):
    """A forked rank starts from the forkserver, which began with an earlier environment and folder: the harness
    hands each rank the caller's at the call, so a test's ``setenv`` and ``chdir`` reach it as they would a
    spawned one's.  Each call gets new processes."""
    from fxshard.testing import spawn

    monkeypatch.setenv("FXSHARD_START_METHOD", method)
    monkeypatch.setenv("FXSHARD_HARNESS_PROBE", "first")
    first = spawn(_seen, 2, timeout=120)
    monkeypatch.setenv("FXSHARD_HARNESS_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    second = spawn(_seen, 2, timeout=120)
    assert [row[0] for row in first] == ["first", "first"] and [row[0] for row in second] == ["second", "second"]
    assert {row[1] for row in second} == {str(tmp_path)}
    assert {row[2] for row in first + second} == {1}
    assert len({row[3] for row in first + second}) == 4


@pytest.mark.e2e  # four command-line processes, two of them fresh interpreters
def test_the_command_line_forked_shows_what_a_fresh_interpreter_shows(monkeypatch, tmp_path):
    """``fxshard.testing.cli``: the command in a process of its own, forked (imports done) or, with
    FXSHARD_START_METHOD=spawn, a fresh ``python -m fxshard.cli.app``: the same status, stdout and stderr either
    way, with the caller's environment and working folder at the call."""
    from fxshard.testing import cli

    (tmp_path / "probe.py").write_text("import os\nraise RuntimeError('probe says ' + os.environ['PROBE'])\n")
    monkeypatch.chdir(tmp_path)
    seen = {}
    for method in ("forkserver", "spawn"):
        monkeypatch.setenv("FXSHARD_START_METHOD", method)
        monkeypatch.setenv("PROBE", method)
        failed = cli("compile", "probe.py", "--tp", 2, "--out", "o", timeout=300)
        assert failed.returncode == 2 and f"probe says {method}" in failed.stderr, failed.stdout + failed.stderr
        assert "Traceback" not in failed.stderr and not (tmp_path / "o").exists()
        version = cli("--version", timeout=300)
        seen[method] = (failed.returncode, failed.stdout, failed.stderr.replace(method, "METHOD"),
                        version.returncode, version.stdout, version.stderr)
    assert seen["forkserver"] == seen["spawn"]
    assert seen["spawn"][3] == 0 and seen["spawn"][4].startswith("fxshard "), seen["spawn"]
