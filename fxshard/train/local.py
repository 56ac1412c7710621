"""``fxshard run`` on one machine: every rank a local process under torch's elastic launcher, supervised.

The launcher and its workers listen on 127.0.0.1 only; torch's per-run log folder lives in a temporary folder
removed after the run; the workers know the launcher's pid (:mod:`fxshard.train.supervise`); a worker
stopped with SIGSTOP is woken to receive the signal that ends it; and a failed or interrupted run ends with
fxshard's own summary (which rank failed first, which were stopped because of it) instead of the agent's
log lines.  Under ``FXSHARD_WORKERS=fork`` (the tests) the workers are forked from this process, not exec'd
(:mod:`fxshard.train.zygote`), and supervised the same way::

    launch_local(Path("out/gpt"), RunOptions(steps=3).argv("out/gpt"), world=2)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path

import torch.distributed as dist

from fxshard.errors import FxshardError, LayoutError
from fxshard.train.supervise import LAUNCHER_PID


def check_gpus(processes: int, world: int, who: str) -> None:
    """Refuse, before NCCL does with "Duplicate GPU detected" or CUDA with "invalid device ordinal", more ranks
    on this machine than it shows GPUs: NCCL runs one rank per GPU.  ``processes``: the ranks on this machine,
    of ``world`` in all; ``who`` opens the message (which rank asks, and how it knows).  No GPU: gloo on the
    CPU, any number of ranks; ``FXSHARD_SHARE_GPU=1``: any number, sharing (:mod:`fxshard.train.device`).

    >>> check_gpus(2, 2, "the layout's 2 ranks would run as 2 processes on this machine")   # one GPU: refused
    """
    import torch

    from fxshard.train.device import SHARE_GPU, sharing_allowed

    if not torch.cuda.is_available() or processes <= (gpus := torch.cuda.device_count()) or sharing_allowed():
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"{gpus} GPU{'s' if gpus > 1 else ''}"
    shown += f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise LayoutError(
        f"{who}, but this machine shows {shown}: NCCL runs one rank per GPU.  Start at most {gpus} "
        f"process{'es' if gpus > 1 else ''} per machine (torchrun --nproc-per-node {gpus} on "
        f"{-(-world // gpus)} machines or more), compile a layout of {gpus} rank{'s' if gpus > 1 else ''} per "
        f"machine, or train on the CPU with gloo (CUDA_VISIBLE_DEVICES= fxshard run ...).  {SHARE_GPU}=1 lets "
        "ranks share a GPU for a test of correctness")


def launch_local(out: Path, argv: list[str], world: int) -> None:
    """Run ``fxshard <argv>`` as ``world`` local processes under torch's elastic launcher."""
    check_gpus(world, world, f"the layout's {world} ranks would run as {world} processes on this machine")
    zygotes = _zygotes(world)  # FXSHARD_WORKERS=fork (the tests): forked now, before the store's threads start
    try:
        _launch(argv, world, zygotes)
    finally:
        if zygotes is not None:
            zygotes.close()


def _launch(argv: list[str], world: int, zygotes) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # one machine: rendezvous and workers on the loopback address only; torch's per-run log folder (the
    # workers' error files) inside a temporary folder removed after the run
    logs = tempfile.TemporaryDirectory(prefix="fxshard-run-")
    store, port = _loopback_store()  # the rendezvous store, which the agent and the workers connect to
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"is_host": False}, max_restarts=0,
        monitor_interval=0.1, start_method="spawn", local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=logs.name),
    )
    env_threads = os.environ.get("OMP_NUM_THREADS")
    if env_threads is None:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    from torch.distributed.elastic.multiprocessing.api import SignalException

    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers' parent: one that finds another exits (supervise)
    try:
        with _loopback_rendezvous(), _stopped_workers_woken(), _agent_quiet(), _forked_workers(zygotes):
            elastic_launch(config, sys.executable)("-m", "fxshard.cli.app", *argv)
    except (SignalException, KeyboardInterrupt) as e:  # the agent has stopped every worker before this
        name = signal.Signals(e.sigval).name if isinstance(e, SignalException) else "SIGINT"
        raise FxshardError(f"interrupted by {name}: the {world} worker processes were stopped") from None
    except ChildFailedError as e:
        raise FxshardError("distributed run failed:\n  " + "\n  ".join(failure_lines(e.failures))) from None
    finally:
        del store
        logs.cleanup()
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        os.environ.pop(LAUNCHER_PID, None)


def _loopback_store(port: int = 0):
    """A TCPStore server listening on 127.0.0.1 only (a TCPStore binds every interface; given a socket bound
    here, it listens on that one), and its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          master_listen_fd=listener.detach())
    return store, port


@contextlib.contextmanager
def _loopback_rendezvous():
    """While launching locally, the store torch's elastic agent creates for its workers (torch 2.13:
    ``DynamicRendezvousHandler._create_tcp_store_server``) listens on 127.0.0.1 only, like the rendezvous's."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = getattr(DynamicRendezvousHandler, "_create_tcp_store_server", None)
    if original is None:  # another torch: its own store, on every interface
        yield
        return
    DynamicRendezvousHandler._create_tcp_store_server = lambda self, addr, port: _loopback_store(port)[0]
    try:
        yield
    finally:
        DynamicRendezvousHandler._create_tcp_store_server = original


def _zygotes(world: int):
    """The children the workers are forked from (:mod:`fxshard.train.zygote`), when ``FXSHARD_WORKERS=fork`` asks
    for them, this torch's agent starts its workers through ``SubprocessHandler._popen``, and this process runs no
    thread yet; else None: the workers are fresh interpreters."""
    from fxshard.train.zygote import Zygotes, fork_requested

    if not fork_requested():
        return None
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
            SubprocessHandler,
        )
    except ImportError:  # another torch
        return None
    return Zygotes.start(world) if hasattr(SubprocessHandler, "_popen") else None


@contextlib.contextmanager
def _forked_workers(zygotes):
    """While launching, torch's agent makes its workers of ``zygotes``' children: its ``SubprocessHandler`` holds a
    :class:`~fxshard.train.zygote.ForkedWorker` where it would hold a ``Popen``, and supervises it the same way."""
    if zygotes is None:
        yield
        return
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
        SubprocessHandler,
    )

    original = SubprocessHandler._popen

    def _popen(self, args, env):
        return zygotes.popen(args, env, self._stdout, self._stderr) or original(self, args, env)

    SubprocessHandler._popen = _popen
    try:
        yield
    finally:
        SubprocessHandler._popen = original


@contextlib.contextmanager
def _stopped_workers_woken():
    """When torch's agent stops its workers, a SIGCONT follows the death signal: a worker stopped with SIGSTOP
    otherwise holds its SIGTERM pending for the agent's 30 s grace before the SIGKILL (torch 2.13:
    ``SubprocessHandler.close``)."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
            SubprocessHandler,
        )
    except ImportError:  # another torch: a stopped worker waits out the agent's grace
        yield
        return
    original = SubprocessHandler.close

    def close(self, death_sig=None):
        original(self, death_sig)
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    SubprocessHandler.close = close
    try:
        yield
    finally:
        SubprocessHandler.close = original


@contextlib.contextmanager
def _agent_quiet():
    """Torch's agent logs each worker it stops and each failure ("Sending process 123 closing signal SIGTERM",
    "failed (exitcode: 2) local_rank: 0 ..."); fxshard's summary says it once, so those lines are dropped, unless
    LOGLEVEL asks for the agent's logs."""
    if "LOGLEVEL" in os.environ:
        yield
        return
    agent = logging.getLogger("torch.distributed.elastic")
    null = logging.NullHandler()
    propagate = agent.propagate
    agent.addHandler(null)  # its loggers' records stop here (a handler, so logging's stderr fallback stays out)
    agent.propagate = False
    try:
        yield
    finally:
        agent.removeHandler(null)
        agent.propagate = propagate


def failure_lines(failures: dict) -> list[str]:
    """One line per failed rank: its own error (from the file :func:`fxshard.runtime.guard.recorded` wrote), or
    the signal that ended it; a rank the agent stopped with SIGTERM because another failed is said to be so."""
    caused = [r for r, f in failures.items() if f.exitcode != -signal.SIGTERM]
    lines = []
    for rank, failure in sorted(failures.items()):
        if failure.exitcode >= 0 or failure.error_file_data.get("message") != "<NONE>":  # torch's "no error file"
            msg = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
            if "pytorch.org/docs/stable/elastic/errors.html" in msg:  # torch's boilerplate: the rank wrote no message
                msg = "it reported no error of its own (its output above says what it printed)"
            lines.append(f"rank {rank} exited with code {failure.exitcode}: {msg[:2000]}")
        elif failure.exitcode == -signal.SIGTERM and caused:
            first = ", ".join(f"rank {r}" for r in sorted(caused))
            lines.append(f"rank {rank} was stopped by the launcher (SIGTERM) because {first} failed")
        else:
            lines.append(f"rank {rank} was killed by {failure.signal_name()} (pid {failure.pid}), not by fxshard")
    return lines

