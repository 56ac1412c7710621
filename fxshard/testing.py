"""A small spawn harness for real multi-process gloo runs: the tests' and the benchmarks'
(no torch.testing._internal).

``spawn(fn, world, *args)`` starts ``world`` processes, each with an initialized gloo process
group and ``threads`` intra-op threads, calls ``fn(rank, world, *args)`` and returns the list of
results (pickled through files).  A worker exception raises here with that rank's traceback; a run
over ``timeout`` seconds is killed and fails, so a broken run never hangs its caller.

The ranks are forked from a forkserver that has imported torch and fxshard once (``PRELOAD``): a spawned
rank spends about 4 s of CPU importing them, a forked one nothing, and a test suite starts hundreds.  The
server only imports (no tensor op, no thread pool, no CUDA), so each rank still starts from clean state; it
gets the caller's environment and working directory at the call, as a spawned one would.
``FXSHARD_START_METHOD=spawn`` starts fresh interpreters instead.

``backend="nccl"`` (the benchmarks on a GPU) puts rank r on GPU r mod the GPUs visible.  With fewer GPUs
than ranks, ranks share a GPU: NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"),
so each rank then gets its own ``NCCL_HOSTID`` and NCCL takes them for separate hosts, joined by its socket
transport over loopback.  The collectives are NCCL's, their transport is not NVLink's: a shared GPU
measures computation and dispatch, not the interconnect.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RENDEZVOUS = timedelta(seconds=180)  # on a loaded 2-core machine a rank's torch import alone has taken over 60 s


# imported once by the forkserver the ranks are forked from; what a rank imports beyond these it imports itself.
# transformers' model base is most tests' and benchmarks' models (the forkserver skips a module not installed)
PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "fxshard.testing", "fxshard.runtime",
           "fxshard.train.launch", "fxshard.compiler", "transformers.modeling_utils"]


def _start_method() -> str:
    method = os.environ.get("FXSHARD_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"FXSHARD_START_METHOD={method!r}: expected 'forkserver' or 'spawn'")
    if method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)  # read when the server starts (this process's first forkserver rank)
    return method


def _store() -> dist.TCPStore:
    """The rendezvous store, held by the parent on a port the OS picks while it listens: a port found free and
    then bound by the ranks could be taken in between by another test's group (pytest-xdist runs two), whose
    ranks then joined this one ("Gloo connectFullMesh failed ... Connection closed by peer")."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=RENDEZVOUS)


def _use_gpu(rank: int, world: int) -> None:
    """This rank's GPU for NCCL; ranks that must share one pose as separate hosts (the module's docstring)."""
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise RuntimeError(f"rank {rank}: backend nccl needs a GPU and torch sees none")
    torch.cuda.set_device(rank % gpus)
    if world > gpus:
        from fxshard.train.device import pose_as_own_host

        pose_as_own_host(rank)


def _worker(rank: int, world: int, port: int, folder: str, threads: int, backend: str, call: bytes,
            env: dict[str, str], cwd: str) -> None:
    os.environ.clear()  # a forked rank has the forkserver's environment: give it the caller's, as spawn does
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    path = Path(folder) / f"rank{rank}.pkl"
    try:
        if backend == "nccl":
            _use_gpu(rank, world)
        # RENDEZVOUS: spawn's own timeout still bounds a broken run
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=RENDEZVOUS)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=RENDEZVOUS)
        try:
            fn, args = pickle.loads(call)
            result = ("ok", fn(rank, world, *args))
        finally:
            # the result goes to the parent before the group is torn down: gloo's teardown has been seen to
            # abort a process ("terminate called without an active exception") after its work was done
            if "result" in locals():
                path.write_bytes(pickle.dumps(result))
            dist.destroy_process_group()
    except BaseException:  # report any failure to the parent with its traceback
        result = ("error", traceback.format_exc())
    path.write_bytes(pickle.dumps(result))
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)  # a forked rank's count starts at its fork
    (Path(folder) / f"rank{rank}.cpu").write_text(repr(used.ru_utime + used.ru_stime))
    from fxshard.train.supervise import exit_finished

    exit_finished()  # reported and torn down: skip the interpreter's teardown, where gloo has aborted ranks


RANKS_CPU = [0.0]  # CPU seconds the ranks of this process's spawns used (their own count: forkserver ranks are
# not this process's children, so its RUSAGE_CHILDREN misses them); the tests' FXSHARD_TEST_CPU report adds it


def _count_cpu(folder: str, world: int) -> None:
    for rank in range(world):
        path = Path(folder) / f"rank{rank}.cpu"
        if path.exists():
            RANKS_CPU[0] += float(path.read_text())


def _joined(ctx, folder: str, world: int) -> bool:
    """Whether every rank has ended.  A rank killed by a signal after it reported success (an abort in the
    process group's teardown) is not a failure of what it ran: the parent warns and reads its result; one
    killed before reporting fails the test with torch's error."""
    try:
        return ctx.join(timeout=1.0)
    except mp.ProcessExitedException as e:
        reports = [Path(folder) / f"rank{rank}.pkl" for rank in range(world)]
        if not reports[e.error_index].exists() or pickle.loads(reports[e.error_index].read_bytes())[0] != "ok":
            raise
        warnings.warn(f"rank {e.error_index} ended by {e.signal_name} after reporting its result (process group "
                      "teardown)", stacklevel=3)
        return all(not p.is_alive() for p in ctx.processes)


def spawn(fn, world: int, *args, timeout: float = 240.0, threads: int = 1, backend: str = "gloo") -> list:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: expected 'gloo' or 'nccl'")
    store = _store()  # held until the ranks are done
    method = _start_method()
    with tempfile.TemporaryDirectory() as folder:
        # the call by value (plain pickle): multiprocessing's own would send each tensor's storage as a file
        # descriptor, and a forkserver takes at most about 250 of them per process ("too many fds")
        call = pickle.dumps((fn, args))
        ctx = mp.start_processes(_worker, args=(world, store.port, folder, threads, backend, call,
                                                dict(os.environ), os.getcwd()),
                                 nprocs=world, join=False, start_method=method)
        import time

        deadline = time.monotonic() + timeout
        while not _joined(ctx, folder, world):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s")
        if method == "forkserver":  # spawned ranks are this process's children: RUSAGE_CHILDREN has them
            _count_cpu(folder, world)
        results = []
        for rank in range(world):
            status, value = pickle.loads((Path(folder) / f"rank{rank}.pkl").read_bytes())
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


def cli(*args, env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``fxshard ARGS`` in a process of its own, as ``subprocess.run([sys.executable, "-m", "fxshard.cli.app", *ARGS],
    capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)`` returns it, forked from the ranks'
    forkserver: the interpreter's start and torch's import (about 5 s of CPU a command) are done once.  The
    process is the real command line: its own pid, its environment (``env``, else the caller's) and working
    folder, stdin from /dev/null, its exit status (an escaping exception prints its traceback and exits 1, as the
    interpreter does; atexit handlers run), and ``fxshard run``'s workers started as the launcher starts them
    (forked from it under ``FXSHARD_WORKERS=fork``, which tests/conftest.py sets: :mod:`fxshard.train.zygote`).
    ``FXSHARD_START_METHOD=spawn``: a fresh interpreter, by ``subprocess.run``.  Tests that signal or time the
    process itself keep ``subprocess.Popen``::

        done = cli("run", out, "--steps", 2)
        assert done.returncode == 0, done.stdout + done.stderr
    """
    argv = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    cwd = str(cwd if cwd is not None else os.getcwd())
    if _start_method() == "spawn":
        return subprocess.run([sys.executable, "-m", "fxshard.cli.app", *argv], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=timeout)
    with tempfile.TemporaryDirectory() as folder:
        process = mp.get_context("forkserver").Process(target=_cli_main, args=(argv, env, cwd, folder),
                                                       name="fxshard")
        process.start()
        process.join(timeout)
        out, err = (Path(folder, name).read_text(errors="replace") if Path(folder, name).exists() else ""
                    for name in ("stdout", "stderr"))
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["fxshard", *argv], timeout, out, err)
        if (cpu := Path(folder, "cpu")).exists():
            RANKS_CPU[0] += float(cpu.read_text())
        code = process.exitcode
        return subprocess.CompletedProcess(["fxshard", *argv], code, out, err)


def _cli_main(argv: list[str], env: dict[str, str], cwd: str, folder: str) -> None:
    """The forked command line: the caller's environment and folder, output to files, ``fxshard.cli.app``'s main."""
    import atexit
    import resource

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[0] = cwd  # as ``python -m`` puts it first
    tempfile.tempdir = None  # read TMPDIR again, as a fresh interpreter would
    for fd, path in ((0, os.devnull), (1, Path(folder, "stdout")), (2, Path(folder, "stderr"))):
        opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["fxshard", *argv]
    code: int | str | None = 0
    try:
        from fxshard.cli.app import main

        main()
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a multiprocessing child skips them: the interpreter's exit runs them
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    self, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    Path(folder, "cpu").write_text(repr(self.ru_utime + self.ru_stime + children.ru_utime + children.ru_stime))
    os._exit(code or 0)


def measure_on_rank(rank: int, world: int, outs: dict[str, str], steps: int = 1) -> dict[str, dict]:
    """On this rank of an initialized process group: train each compiled folder of ``outs`` for ``steps``
    steps and return what the rank held, by name (a spawn target for tests and benchmarks)."""
    from fxshard.train.launch import train
    from fxshard.train.options import RunOptions

    found = {}
    for name, out in outs.items():
        memory: dict = {}
        train(Path(out), RunOptions(steps), log=lambda *_: None, memory=memory)
        found[name] = memory
    return found


@dataclass(frozen=True)
class CaseFailure:
    """Why one case of a shared spawn has no result: its own traceback (every rank that raised), or the case
    before it that failed, since the process group may be left mid-collective and later cases are not run."""

    message: str


def _cases_worker(rank: int, world: int, fn, items: list[tuple[str, tuple]]) -> dict:
    results = {}
    for key, args in items:
        try:
            results[key] = ("ok", fn(*args))
        except BaseException:
            results[key] = ("error", f"rank {rank}:\n{traceback.format_exc()}")
            break
    return results


def spawn_cases(fn, world: int, items: list[tuple[str, tuple]], timeout: float = 600.0) -> dict:
    """Run ``fn(*args)`` for each ``(key, args)`` of ``items`` in one set of ``world`` spawned processes (spawning
    costs seconds; cases cost less).  Returns ``{key: [result per rank]}``, or ``{key: CaseFailure}`` for a case
    that raised on some rank or could not run, so each case's test fails with its own cause::

        results = spawn_cases(train_one, 2, [("gpt-tp2", (out,)), ...])
    """
    try:
        per_rank = spawn(_cases_worker, world, fn, items, timeout=timeout)
    except Exception as e:  # a rank died or the spawn timed out: no case of it has a result
        return {key: CaseFailure(f"the shared spawn of {world} processes failed: {e}") for key, _ in items}
    found: dict = {}
    failed = None
    for key, _ in items:
        rows = [r.get(key) for r in per_rank]
        errors = [row[1] for row in rows if row is not None and row[0] == "error"]
        if errors:
            found[key] = CaseFailure("\n".join(errors))
            failed = failed or key
        elif any(row is None for row in rows):
            found[key] = CaseFailure(f"not run: case {failed!r} failed before it in the same process group")
        else:
            found[key] = [row[1] for row in rows]
    return found


def selected_cases(request, cases, fixture: str = "trained") -> list[str]:
    """The cases of ``cases`` (ids of ``@pytest.mark.parametrize("case", ...)``) whose tests this session runs and
    that read the module fixture ``fixture``, so it compiles and trains those alone (``pytest -k tp2-sp``); all
    of them when a test of the module reads the fixture without a ``case``."""
    chosen = set()
    for item in request.session.items:
        if item.module is not request.module or fixture not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "case" not in params:
            return list(cases)
        chosen.add(params["case"])
    return [c for c in cases if c in chosen]


def matrix(cases, keep) -> list:
    """The values for ``@pytest.mark.parametrize`` over a broad matrix of ``cases``: those in ``keep`` run in
    ``make test``, a representative of each feature; every other case is marked ``matrix``, which ``make test``
    deselects and ``make test-matrix`` runs.  ``selected_cases`` then leaves the module fixture's spawn the kept
    cases alone."""
    import pytest

    cases = list(cases)
    unknown = sorted(set(keep) - set(cases))
    if unknown:
        raise ValueError(f"matrix: kept cases {unknown} are not among the cases {cases}")
    return [c if c in keep else pytest.param(c, marks=pytest.mark.matrix) for c in cases]


def case_result(results: dict, key: str):
    """The per-rank results of one case of :func:`spawn_cases`; fails the calling test with the case's cause."""
    import pytest

    result = results[key]
    if isinstance(result, CaseFailure):
        pytest.fail(f"{key}: {result.message}", pytrace=False)
    return result


# ---------------------------------------------------------------- batches for the model zoo (zoo/models/*.py)

LENGTHS = (16, 3, 12, 5)  # real tokens per row: right padding, unevenly, so every split of the batch differs


def padded_batch(vocab: int, pad: int, seq: int = 16, lengths=LENGTHS, first_id: int = 1):
    """``(input_ids, attention_mask)`` of a right-padded batch whose pads are the ``pad`` id."""
    import torch

    ids = torch.randint(first_id, vocab, (len(lengths), seq))
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids.masked_fill(mask == 0, pad), mask


def causal_lm_batch(vocab: int, pad: int, seq: int = 16) -> dict:
    """A causal LM batch with padding, its attention mask and labels -100 on the pads."""
    ids, mask = padded_batch(vocab, pad, seq)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100), "use_cache": False}


def masked_lm_batch(vocab: int, pad: int, mask_id: int, seq: int = 16, masked=(5, 1, 0, 3)) -> dict:
    """A masked LM batch: padding, and labels -100 except at a few masked positions per row (none in one)."""
    import torch

    ids, mask = padded_batch(vocab, pad, seq, first_id=max(pad, mask_id) + 1)
    labels = torch.full_like(ids, -100)
    for row, (n, k) in enumerate(zip(LENGTHS, masked, strict=True)):
        where = torch.randperm(n)[:k]
        labels[row, where] = ids[row, where]
        ids[row, where] = mask_id
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seq2seq_batch(vocab: int, pad: int, seq: int = 16, target: int = 8) -> dict:
    """An encoder-decoder batch: padded sources with their mask, padded targets labelled -100 on the pads."""
    ids, mask = padded_batch(vocab, pad, seq)
    labels, label_mask = padded_batch(vocab, pad, target, lengths=(8, 2, 5, 3))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(label_mask == 0, -100),
            "use_cache": False}


def without_dropout(config):
    """``config`` with every dropout probability at 0 (the zoo compares training without dropout), its sub-configs'
    too (a vision-language model's text and vision configs); layer drop and stochastic depth (``layerdrop``,
    ``drop_path_rate``), which skip whole layers at random, are dropout of layers and go to 0 as well."""
    for name, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            without_dropout(value)
        elif any(k in name for k in ("dropout", "pdrop", "layerdrop", "drop_path")) or name.endswith("_drop"):
            if isinstance(value, float):
                setattr(config, name, 0.0)
    return config
