"""Rank workers forked from the launcher instead of exec'd: the test harness's start method (``FXSHARD_WORKERS=fork``).

``fxshard run``'s launcher starts each rank as ``python -m fxshard.cli.app run ...``, a fresh interpreter that spends
about 5 s of CPU importing torch, torch._dynamo and fxshard before a test's few tiny steps; the launcher has imported
them already.  With ``FXSHARD_WORKERS=fork`` (the tests set it; users never need it) the launcher forks one child per
rank before it starts any thread (the rendezvous store's, the agent's), and each child waits for the agent's order to
become its rank.  The agent handles a :class:`ForkedWorker`, which answers as ``subprocess.Popen`` does (``pid``,
``poll``, ``wait``, ``send_signal``, ``returncode``), so the supervision stays one code path.  A forked worker is what
an exec'd one is: the launcher's child with its own pid, in a session of its own; the rank's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), set before its module runs and shown in ``/proc/PID/environ`` and
``cmdline`` as an exec'd worker's are; the standard streams the agent gives it; torch's default random state, the
launcher's ``atexit`` handlers dropped; ``python -m MODULE``'s exit status (an escaping exception prints its
traceback and exits 1; ``os._exit`` ends it at once).  One difference: a forked worker runs one intra-op thread
(``OMP_NUM_THREADS=1``, as the harness's ranks), since an OpenMP pool the launcher started is not the child's.  A
launcher that runs a Python thread or CUDA (:func:`may_fork`), or another torch (no ``SubprocessHandler._popen``),
execs its workers as usual::

    zygotes = Zygotes.start(2)         # before any thread
    proc = zygotes.popen((sys.executable, "-m", "fxshard.cli.app", "run", "out"), env, None, None)
    proc.wait()
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

WORKERS = "FXSHARD_WORKERS"  # "fork": forked from the launcher (tests); unset or "exec": fresh interpreters
_TORCH_DEFAULT_SEED = 67280421310721  # c10's default_rng_seed_val: a fresh interpreter's torch generator
_SHOWN: list = []  # the buffers /proc/self/environ and cmdline point at, alive as long as the process


def fork_requested() -> bool:
    """Whether ``FXSHARD_WORKERS`` asks for forked workers (anything but ``fork`` or ``exec`` is refused)."""
    method = os.environ.get(WORKERS, "exec")
    if method not in ("fork", "exec"):
        from fxshard.errors import FxshardError

        raise FxshardError(f"{WORKERS}={method!r}: expected 'exec' (fresh interpreters, the default) or 'fork'")
    return method == "fork"


def may_fork() -> bool:
    """Whether this process may be forked with torch imported: no Python thread but this one (the agent's, a
    driver's), no CUDA (a driver forked after its start fails in the child).  Threads of C libraries are let be:
    OpenBLAS stops its pool around a fork (numpy's, loaded with torch, starts one at import), and torch's OpenMP
    pool, started by a tensor op, is never entered by a worker of one intra-op thread, which a forked worker is."""
    import threading

    if threading.active_count() != 1 or not os.path.isdir("/proc/self"):
        return False
    torch = sys.modules.get("torch")
    return torch is None or not (torch.cuda.is_initialized() or torch.cuda.is_available())


class ForkedWorker:
    """A forked worker as ``subprocess.Popen`` shows a process: ``returncode`` is the exit status, or minus the
    signal that ended it, once :meth:`poll` or :meth:`wait` has seen it end."""

    def __init__(self, pid: int, args: tuple):
        self.pid, self.args, self.returncode = pid, args, None
        self._lock = threading.Lock()  # the agent polls from its monitor while its close() waits

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): Popen reports 0 too
                    pid, status = self.pid, 0
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may since be another process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygotes:
    """``count`` children of this process, forked at :meth:`start`, each waiting to become one worker."""

    def __init__(self, children: list[tuple[int, socket.socket]]):
        self._waiting = children

    @classmethod
    def start(cls, count: int) -> Zygotes | None:
        """Fork the children now; None where this process may not be forked (:func:`may_fork`)."""
        if not may_fork():
            return None
        for stream in (sys.stdout, sys.stderr):  # else what is buffered here would be printed again by each child
            with contextlib.suppress(Exception):
                stream.flush()
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(count)]
        launcher = os.getpid()
        children = []
        for own, theirs in pairs:
            pid = os.fork()
            if pid == 0:
                for sock in [s for pair in pairs for s in pair if s is not theirs]:
                    sock.close()
                _await_order(theirs, launcher)  # never returns
            theirs.close()
            children.append((pid, own))
        return cls(children)

    def popen(self, args: tuple, env: dict[str, str], stdout, stderr) -> ForkedWorker | None:
        """Make the next waiting child the worker ``args`` (``python -m MODULE ARGV...``), with ``env`` and the
        given standard streams (open files, or None to keep this process's); None for a command of another form."""
        if len(args) < 3 or args[0] != sys.executable or args[1] != "-m" or not self._waiting:
            return None
        pid, sock = self._waiting.pop(0)
        streams = [(fd, f.fileno()) for fd, f in ((1, stdout), (2, stderr)) if f is not None]
        env = dict(env, OMP_NUM_THREADS="1")  # one intra-op thread (:func:`may_fork`), as the test harness's ranks
        order = pickle.dumps((tuple(args), env, [fd for fd, _ in streams]))
        with contextlib.suppress(OSError):  # a child killed while it waited: the agent sees its status as the rank's
            socket.send_fds(sock, [order], [f for _, f in streams])
        sock.close()
        return ForkedWorker(pid, tuple(args))

    def close(self) -> None:
        """End the children no worker was made of (closing their sockets ends them) and reap them."""
        for pid, sock in self._waiting:
            sock.close()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._waiting = []


def _await_order(sock: socket.socket, launcher: int) -> None:
    """In a forked child: die with the launcher, wait for the order, become the worker it names; exit either way."""
    code = 1
    try:
        os.setsid()  # a session of its own, as the agent's Popen(start_new_session=True) gives: the terminal's ^C
        # reaches the launcher alone, and the agent's killpg(pid) reaches this worker and its children
        from fxshard.train.supervise import die_with_parent

        die_with_parent(launcher)
        order, fds, _, _ = socket.recv_fds(sock, 1 << 22, 2)
        sock.close()
        if not order:  # the launcher closed the socket: no worker is wanted
            os._exit(0)
        args, env, targets = pickle.loads(order)
        for fd, target in zip(fds, targets, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        code = _become(args, env)
    except BaseException:  # noqa: BLE001 - nothing may unwind into the launcher's frames
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _become(args: tuple, env: dict[str, str]) -> int:
    """Run ``python -m MODULE ARGV...`` here as a fresh interpreter would; its exit status."""
    import atexit
    import random
    import runpy
    import tempfile
    import traceback

    os.environ.clear()
    os.environ.update(env)
    _show_in_proc(args, env)
    tempfile.tempdir = None  # TMPDIR read again
    random.seed()  # the launcher's sequence is not the rank's
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.manual_seed(_TORCH_DEFAULT_SEED)
        torch.set_num_threads(1)  # OpenMP read the launcher's OMP_NUM_THREADS at its start, not the rank's
    atexit._clear()  # the launcher's handlers are the launcher's
    sys.argv = [args[2], *args[3:]]  # run_module puts the module's file first, as -m does
    code: object = 0
    try:
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # the interpreter ends by SIGINT itself, so its parent sees the signal
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter's own handling of an escaping exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    if code == -signal.SIGINT:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code & 0xFF


class _MmMap(ctypes.Structure):  # linux/prctl.h's struct prctl_mm_map
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack", "arg_start",
        "arg_end", "env_start", "env_end", "auxv")] + [("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


def _show_in_proc(args: tuple, env: dict[str, str]) -> None:
    """Point ``/proc/self/cmdline`` and ``environ`` at the worker's own (an exec'd worker shows them; tools and the
    supervision tests find a rank's pid by its RANK there); a forked one would show the launcher's.  Uses
    ``prctl(PR_SET_MM, PR_SET_MM_MAP)`` (Linux with checkpoint/restore, no privilege needed); where it is refused,
    ``/proc`` keeps showing the launcher's."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    blocks = [b"".join(s.encode() + b"\0" for s in strings)
              for strings in (args, [f"{k}={v}" for k, v in env.items()])]
    buffers = [ctypes.create_string_buffer(block, len(block)) for block in blocks]
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()  # fields[0] is the stat's field 3
    except OSError:
        return
    field = lambda n: int(fields[n - 3])  # noqa: E731
    (arg, arg_len), (environ, env_len) = ((ctypes.addressof(b), len(b.raw)) for b in buffers)
    layout = _MmMap(start_code=field(26), end_code=field(27), start_data=field(45), end_data=field(46),
                    start_brk=field(47), brk=libc.sbrk(0) or 0, start_stack=field(28), arg_start=arg,
                    arg_end=arg + arg_len, env_start=environ, env_end=environ + env_len, auxv=0, auxv_size=0,
                    exe_fd=0xFFFFFFFF)
    if libc.prctl(35, 14, ctypes.byref(layout), ctypes.sizeof(layout), 0) == 0:  # PR_SET_MM, PR_SET_MM_MAP
        _SHOWN.append(buffers)
