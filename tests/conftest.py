import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(2)
# `fxshard run`'s workers forked from its launcher, not exec'd (fxshard.train.zygote; docs/testing.md), in every
# launcher a test starts (`fxshard.testing.cli`'s and `subprocess`'s); FXSHARD_START_METHOD=spawn keeps them fresh
# interpreters, as it does the harness's ranks
if os.environ.get("FXSHARD_START_METHOD") != "spawn":
    os.environ.setdefault("FXSHARD_WORKERS", "fork")


@pytest.fixture
def samples():
    return ROOT / "samples"


@pytest.fixture
def models():
    return ROOT / "tests" / "models"


# `make test-fast` (FXSHARD_TEST_FAST=1) runs the tests that start no process group; a test that does start
# one without its `distributed` / `e2e` marker fails there, naming itself, instead of slowing the edit loop.
# The guard sits where processes and groups start (torch's process starters, its elastic launcher, a default
# process group), not on fxshard's own launchers, so their checks before launch still run and are testable:
# `fxshard run`'s refusals run in-process up to the point where it would start its workers.
if os.environ.get("FXSHARD_TEST_FAST") == "1":
    import torch.distributed as dist
    import torch.distributed.launcher.api as launcher
    import torch.multiprocessing as mp
    import torch.multiprocessing.spawn as mp_spawn

    def _refuse(*args, **kwargs):
        raise RuntimeError("this test starts a process group: mark it @pytest.mark.distributed (or e2e)")

    dist.init_process_group = _refuse
    mp.start_processes = mp_spawn.start_processes = mp.spawn = mp_spawn.spawn = _refuse
    launcher.elastic_launch = _refuse


# `FXSHARD_TEST_CPU=1`: after the run, the 15 tests that took the most CPU time (this process's and its waited-for
# children's, setup included). On a machine other work shares, wall times (`--durations`) measure the load as much
# as the test; CPU time measures the test.
if os.environ.get("FXSHARD_TEST_CPU") == "1":
    import resource
    import time

    _cpu: dict[str, float] = {}

    from fxshard.testing import RANKS_CPU

    def _now() -> float:  # the ranks of fxshard.testing.spawn count their own (forked from a forkserver)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime + RANKS_CPU[0]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = _now()
        yield
        _cpu[item.nodeid] = _now() - start

    def pytest_terminal_summary(terminalreporter):
        if not _cpu:  # pytest-xdist's controller: the workers ran the tests (run without -n to measure)
            return
        total = sum(_cpu.values())
        terminalreporter.write_sep("=", f"CPU time: {total:.1f} s in {len(_cpu)} tests; the 15 costliest")
        for nodeid, seconds in sorted(_cpu.items(), key=lambda kv: -kv[1])[:15]:
            terminalreporter.write_line(f"{seconds:8.2f}s  {nodeid}")


# State a test can leave behind in torch that turns the next tests' real tensors into fakes: a dispatch mode (a
# FakeTensorMode of a capture or a plan, held by a generator never closed), a torch function mode, or
# torch.compile's frame callback (every later Python frame then traced by dynamo, with fake tensors).  Each is removed
# after the test that left it, which a warning names, so it cannot reach the tests after it.  (Written for
# tests/runtime/test_cp_ring_causal.py's comparison of real tensors as fakes, "Could not guard on data-dependent
# expression" inside assert_close, after earlier tests on its worker; the dispatch-mode check alone did not stop it.)
@pytest.fixture(autouse=True)
def _no_dispatch_mode_left_behind(request):
    yield
    import sys
    import warnings

    from torch.overrides import _get_current_function_mode_stack
    from torch.overrides import _pop_mode as _pop_function_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    left = [type(mode).__name__ for mode in _get_current_dispatch_mode_stack()]
    while _get_current_dispatch_mode_stack():
        _pop_mode()
    functions = [type(mode).__name__ for mode in _get_current_function_mode_stack()]
    while _get_current_function_mode_stack():
        _pop_function_mode()
    callback = None
    if "torch._dynamo" in sys.modules:
        from torch._C._dynamo import eval_frame

        if (callback := eval_frame.get_eval_frame_callback()) is not None:
            eval_frame.set_eval_frame(None)
    if left or functions or callback is not None:
        warnings.warn(f"{request.node.nodeid} left torch state active (removed): dispatch modes {left}, function modes "
                      f"{functions}, torch.compile frame callback {callback!r}", stacklevel=1)
