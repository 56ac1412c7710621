"""Write a compiled program into its output folder without ever losing a file fxshard did not write.

The new program is written into a temporary sibling folder (same filesystem), then swapped in: the folder
and the sibling exchange names in one ``renameat2(RENAME_EXCHANGE)`` where the kernel offers it (two renames
otherwise), and any file the old manifest did not list (a user's metrics, checkpoints, notes) is moved
across into the new folder.  A compile that fails or is interrupted before the swap leaves the old folder as
it was and removes its temporary sibling.  Only a folder that is empty, new, or holds an fxshard manifest is
ever replaced::

    with staged_output(Path("out/gpt")) as stage:
        (stage / "manifest.json").write_text(...)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import secrets
import shutil
import signal
import stat
import threading
from pathlib import Path

from fxshard.codegen.manifest import FORMAT, MANIFEST, listed_files
from fxshard.errors import OutputFolderError


def _files(folder: Path) -> set[str]:
    """The folder's entries as paths relative to it; inside ``weights/`` (fxshard's, which may also hold a
    user's file), its files one by one."""
    names = {p.name for p in folder.iterdir() if p.name != "weights"}
    if (folder / "weights").is_dir():
        names |= {f"weights/{p.name}" for p in (folder / "weights").iterdir()}
    elif (folder / "weights").exists():
        names.add("weights")
    return names


def check_target(out: Path, new_names: set[str]) -> set[str]:
    """Refuse an ``out`` that fxshard may not write into; return the names of the old folder's files that are
    not fxshard's (they are carried over into the new folder)."""
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"{out}: exists and is a file, not a folder; choose a folder for --out")
    if not out.exists() or not any(out.iterdir()):
        return set()
    manifest_path = out / MANIFEST
    if not manifest_path.is_file():
        raise OutputFolderError(f"{out}: exists and is not an fxshard output folder (no {MANIFEST}); "
                                "choose an empty or new folder")
    if not os.access(out, os.W_OK):  # the swap moves the user's files out of it: refuse before any work
        raise OutputFolderError(f"{out}: is read-only, so fxshard cannot replace the program in it; make it "
                                f"writable (chmod u+w {out}) or choose another folder")
    listed = listed_files(manifest_path)
    if listed is None:
        raise OutputFolderError(f"{out}: its {MANIFEST} is not fxshard's (no format {FORMAT}, fxshard_version and rank "
                                "list), so the folder is not fxshard's to replace; choose an empty or new folder")
    foreign = _files(out) - listed
    clash = sorted(foreign & new_names)
    if clash:
        raise OutputFolderError(f"{out}: {', '.join(clash)} would be overwritten but the folder's manifest does not "
                                "list them (fxshard did not write them); move them away or choose another folder")
    return foreign


@contextlib.contextmanager
def staged_output(out: Path, new_names: set[str]):
    """Yield an empty staging folder beside ``out``; on a clean exit, swap it in as ``out``."""
    out = Path(out).resolve()  # '.' has no name to put a sibling beside; a symlink: replace what it points at
    check_target(out, new_names)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _terminate_as_interrupt():
        stage = _sibling(out, "new")
        swapping = False
        try:
            yield stage
            with _signals_held():  # from here the new program is complete: the swap runs to its end
                # listed again: a file written into ``out`` while the program was (a run's metrics) stays theirs
                foreign = check_target(out, new_names)
                if out.is_dir():  # a recompiled folder keeps its mode (set now: a read-only one was still written)
                    os.chmod(stage, stat.S_IMODE(out.stat().st_mode))
                swapping = True  # the stage may hold the old folder from now on: never remove it
                _swap_in(stage, out, foreign)
        except BaseException:
            if not swapping:
                shutil.rmtree(stage, ignore_errors=True)
            raise


def _sibling(out: Path, tag: str) -> Path:
    """A new hidden folder beside ``out``, with the umask's permissions as mkdir gives them, not the 0700 of a
    temporary folder: a compiled folder others could read stays readable."""
    while True:
        path = out.parent / f".{out.name}.fxshard-{tag}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


_INTERRUPTS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so a terminated compile removes its staging folder
    (Python's default for SIGTERM ends the process on the spot)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C and SIGTERM back for the block; one that arrived meanwhile is dropped: the compile it meant to
    stop has finished, and the folder holds the complete new program."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPTS)
    try:
        yield
    finally:
        for _ in _INTERRUPTS & signal.sigpending():
            signal.sigwait(_INTERRUPTS)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _INTERRUPTS)


def _swap_in(stage: Path, out: Path, foreign: set[str]) -> None:
    if not out.exists():
        os.rename(stage, out)
        return
    if _exchange(stage, out):  # one atomic step: out is the new program, stage holds the old folder
        old, trash = stage, stage
    else:
        trash = _sibling(out, "old")
        old = trash / out.name
        os.rename(out, old)
        os.rename(stage, out)
    for name in sorted(foreign):  # the user's files stay where they were
        os.rename(old / name, out / name)
    shutil.rmtree(trash)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where the call is unavailable."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), _RENAME_EXCHANGE)
    return rc == 0
