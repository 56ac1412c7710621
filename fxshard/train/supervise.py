"""Keep a run supervised: workers die with whoever started them, and one run at a time writes a checkpoint.

A worker asks the kernel for SIGKILL when its parent (the ``fxshard run`` launcher, or torchrun's agent) dies
(``prctl(PR_SET_PDEATHSIG)``), so a ``kill -9`` of the launcher cannot leave ranks training and saving
unsupervised.  A checkpoint folder is locked (``flock`` on ``DIR/.lock``, released by the kernel when its
holder exits however it exits) by the run writing it; a second run is refused, naming the holder's pid::

    with checkpoint_lock(Path("ckpt")):
        ...   # train and save
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
from pathlib import Path

from fxshard.errors import FxshardError

_PR_SET_PDEATHSIG = 1
LOCK = ".lock"
LAUNCHER_PID = "FXSHARD_LAUNCHER_PID"  # set by the local launcher for its workers: the parent they must have


def become_worker() -> None:
    """Set up a rank process started by a launcher: it dies with the launcher (:func:`die_with_parent`), Ctrl-C
    ends it at once as SIGTERM does (a KeyboardInterrupt unwinding while gloo's and the store's threads run can
    abort with C++'s "terminate called without an active exception"), and its step lines reach the launcher's
    output as they are printed, not in blocks when a pipe's buffer fills."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)


def exit_finished(code: int = 0) -> None:
    """End a rank process whose work is done and written: flush its output and stop torch's compile workers,
    then leave without the interpreter's teardown.  There gloo's threads, still referenced by objects that
    outlive ``destroy_process_group`` (compiled graphs, FSDP2 and DDP state), have aborted a finished rank
    ("terminate called without an active exception", SIGABRT: a CI run lost a passing ``verify --compile`` to
    it); torch's own fix, an exit handler that destroys the groups first, was abandoned (pytorch#179291)."""
    import logging

    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        with contextlib.suppress(Exception):  # the work is written: a pool that fails to stop must not fail the run
            async_compile.shutdown_compile_workers()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent exits (Linux; elsewhere nothing happens).

    The request only covers a parent still alive when it is made; a worker whose launcher died while it was
    starting (importing torch takes seconds) has already been handed to init, so it compares its parent with
    the launcher's pid it was given (``parent``, else :data:`LAUNCHER_PID`'s) and exits."""
    parent = parent or int(os.environ.get(LAUNCHER_PID) or os.getppid())
    from fxshard.files import libc

    prctl = libc.function("prctl")  # not ctypes.util.find_library: it starts a process (fxshard.files.libc)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request: nobody supervises this rank
        os._exit(1)


class CheckpointBusyError(FxshardError):
    """Another run holds the checkpoint folder."""


@contextlib.contextmanager
def checkpoint_lock(folder: Path):
    """Hold ``folder``'s lock for the block; refuse when another live process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    from fxshard.files import open_no_follow

    fd = open_no_follow(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644, "the checkpoint's lock")  # a planted link:
    # refused by name, never truncated through
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise CheckpointBusyError(
                f"{folder}: another run (pid {holder}) is writing this checkpoint folder; wait for it to finish or "
                "stop it, or choose another --checkpoint folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_unlocked(folder: Path) -> None:
    """Before launch: refuse a checkpoint folder another run holds (the folder is created if new)."""
    with checkpoint_lock(folder):
        pass
