"""A folder fxshard writes whole (a compiled program, an export), replaced without ever losing a file it did not write.

The new folder is written into a hidden sibling folder (same filesystem), then swapped in: the folder and the
sibling exchange names in one ``renameat2(RENAME_EXCHANGE)`` where the kernel offers it (two renames
otherwise), and any file the old folder's record did not list (a user's metrics, checkpoints, notes) is moved
across into the new folder.  Only a folder that is empty, new, or holds fxshard's record (a compiled program's
``manifest.json``, an export's ``fxshard-export.json``: the :class:`FolderKind` says which) is ever replaced.

Signals: from the moment the sibling exists, Ctrl-C and SIGTERM raise :class:`Interrupted` in the main thread
(Python runs every signal handler there, whichever thread the kernel chose), except during the swap, where
they are noted and raised once it is complete: the folder is then the old program or the new one, never half.

A ``kill -9`` cannot be caught, so the sibling carries a journal (``.fxshard-swap``), locked by the process
that writes it and saying what the swap will do before it does it.  The next write of the same folder
(:func:`recover_interrupted`) finds a journal whose lock is free and finishes or undoes what it says, and
says so.  The writer starts no process while it holds the lock (a forked child holds a copy of it until it execs;
:mod:`fxshard.files.libc`); a dead writer's journal still locked is waited for a few seconds, then refused::

    with staged_output(Path("out/gpt"), {"manifest.json", ...}, PROGRAM) as stage:
        write_text(stage / "manifest.json", text, "the manifest", owner=STAGE)

A folder of fxshard's own whose steps are written in place by several processes (a checkpoint's ``step-N``) is
staged by its writer and put in place with :func:`publish_folder`; :func:`remove_folder` deletes one so that a
deletion cut short leaves nothing under its name.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fxshard.errors import OutputFolderError, warn
from fxshard.files import libc
from fxshard.files.owned import _alive
from fxshard.files.single import open_no_follow

JOURNAL = ".fxshard-swap"  # in the staging folder: travels with it through the exchange
STAGE = "the staging folder"  # the owner of a file written into one (its record is the folder's, written last)
INHERITED_WAIT_S = 5.0  # a dead writer's journal still locked: how long its children may hold the lock
STOP_ENV = "FXSHARD_TEST_STOP_IN_SWAP"  # tests: the compile stops itself (SIGSTOP) at this point of the swap


@dataclass(frozen=True)
class FolderKind:
    """What fxshard writes a folder of: the record that lists its own files there, and the flag naming it."""

    what: str  # "output", as in "an fxshard output folder"
    noun: str  # "program": what the folder holds
    verb: str  # "compile": what writes it
    flag: str  # "--out"
    record: str  # the file listing fxshard's files: manifest.json
    listed: Callable[[Path], set[str] | None]  # the record's files, or None when fxshard did not write it
    subfolders: tuple[str, ...] = ()  # fxshard's folders whose files are listed one by one (weights/)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the write; ``swapped``: it arrived during the swap, which was completed first."""

    def __init__(self, signal_name: str, swapped: bool = False):
        super().__init__(signal_name)
        self.swapped = swapped


def _files(folder: Path, kind: FolderKind) -> set[str]:
    """The folder's entries as paths relative to it; inside fxshard's subfolders (``weights/``, which may also
    hold a user's file), their files one by one."""
    names = {p.name for p in folder.iterdir() if p.name not in kind.subfolders}
    for sub in kind.subfolders:
        if (folder / sub).is_dir() and not (folder / sub).is_symlink():
            names |= {f"{sub}/{p.name}" for p in (folder / sub).iterdir()}
        elif os.path.lexists(folder / sub):
            names.add(sub)
    return names


def check_target(out: Path, new_names: set[str], kind: FolderKind) -> set[str]:
    """Refuse an ``out`` that fxshard may not write into; return the names of the old folder's files that are
    not fxshard's (they are carried over into the new folder)."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"{out}: exists and is a file, not a folder; choose a folder for {kind.flag}")
    if not out.exists():
        return set()
    _one_filesystem(out, set(), kind)  # a mount point cannot be renamed, even empty
    if not any(out.iterdir()):
        return set()
    record = out / kind.record
    if not record.is_file():
        raise OutputFolderError(f"{out}: exists and is not an fxshard {kind.what} folder (no {kind.record}); "
                                "choose an empty or new folder")
    if not os.access(out, os.W_OK):  # the swap moves the user's files out of it: refuse before any work
        raise OutputFolderError(f"{out}: is read-only, so fxshard cannot replace the {kind.noun} in it; make it "
                                f"writable (chmod u+w {shlex.quote(str(out))}) or choose another folder")
    listed = kind.listed(record)
    if listed is None:
        raise OutputFolderError(f"{out}: its {kind.record} is not fxshard's, so the folder is not fxshard's to "
                                "replace; choose an empty or new folder")
    for sub in kind.subfolders:
        if (out / sub).is_symlink():  # its target's files would be moved out of it and the link replaced
            raise OutputFolderError(f"{out / sub}: is a symbolic link (to {os.readlink(out / sub)}); fxshard writes "
                                    f"{sub}/ as a folder of its own and replaces it on every compile. Move your files "
                                    f"out of the link's target and remove the link, or choose another {kind.flag}")
    foreign = _files(out, kind) - listed - {JOURNAL}
    clash = sorted(foreign & new_names)
    if clash:
        raise OutputFolderError(f"{out}: {', '.join(clash)} would be overwritten but the folder's {kind.record} does "
                                "not list them (fxshard did not write them); move them away or choose another folder")
    _one_filesystem(out, foreign, kind)
    return foreign


def _one_filesystem(out: Path, foreign: set[str], kind: FolderKind) -> None:
    """The swap renames: the folder onto its sibling's name, the user's files into the new folder.  A rename cannot
    cross filesystems, so a mount point among them is refused now, before anything moves."""
    device = os.lstat(out.parent).st_dev
    entries = [out] + [out / sub for sub in kind.subfolders if (out / sub).is_dir()] + [out / n for n in foreign]
    for path in entries:
        if os.lstat(path).st_dev != device:
            raise OutputFolderError(
                f"{path}: is on another filesystem (a mount point) than {out.parent}; fxshard replaces the "
                f"{kind.noun} by renaming folders and files beside it, which cannot cross filesystems. "
                + (f"Give {kind.flag} a folder inside it" if path == out else "Unmount it or move it out of "
                   f"{out}, or choose another {kind.flag}"))


@contextlib.contextmanager
def staged_output(out: Path, new_names: set[str], kind: FolderKind):
    """Yield an empty staging folder beside ``out``; on a clean exit, swap it in as ``out``."""
    out = Path(out).resolve()  # '.' has no name to put a sibling beside; a symlink: replace what it points at
    recover_interrupted(out, kind)
    check_target(out, new_names, kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _Signals() as signals:
        stage = None
        try:
            with signals.held(swapped=False):  # the sibling and its locked journal, whole
                stage = _Stage(out)
            yield stage.path
            with signals.held(swapped=True):  # from here the new program is complete: the swap runs to its end
                # listed again: a file written into ``out`` while the program was (a run's metrics) stays theirs,
                # and none may have the name of one the stage now holds
                foreign = check_target(out, new_names | (_files(stage.path, kind) - {JOURNAL}), kind)
                if out.is_dir():  # a recompiled folder keeps its mode (set now: a read-only one was still written)
                    os.chmod(stage.path, stat.S_IMODE(out.stat().st_mode))
                stage.swap_in(out, foreign)
                signals.swapped = True
        except BaseException:
            if stage is not None and not stage.swapped:
                with signals.held(swapped=None):  # the stop under way is this one
                    stage.remove()
            raise
        finally:
            if stage is not None:
                stage.close()


class _Signals:
    """SIGINT and SIGTERM raise :class:`Interrupted`, or, inside :meth:`held`, are noted and raised after it.

    Python runs a signal's handler in the main thread whichever thread the kernel delivered it to (torch's
    threads take SIGTERM as readily as the main one), so the handler itself decides; masking the signal in the
    main thread alone, as an earlier version did, let a SIGTERM through another thread interrupt the swap."""

    def __init__(self):
        self.holding = False
        self.noted: str | None = None
        self.previous: dict[int, object] = {}
        self.swapped = False  # the swap is done: a signal handled after its block (late, a loaded machine) says so

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # a background job's ignored Ctrl-C stays ignored
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.holding:
            self.noted = self.noted or name
            return
        raise Interrupted(name, swapped=self.swapped)

    @contextlib.contextmanager
    def held(self, swapped: bool | None):
        """Note a signal during the block; when it ends, raise it as :class:`Interrupted` (``swapped``: the block
        was the swap), or drop it (None: the block is the clean-up of a stop already under way)."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.noted is not None and swapped is not None:  # the block finished: the signal's stop comes now
            raise Interrupted(self.noted, swapped=swapped)


def _sibling(out: Path, tag: str, create: bool = True) -> Path:
    """A new hidden folder beside ``out``, with the umask's permissions as mkdir gives them, not the 0700 of a
    temporary folder: a compiled folder others could read stays readable."""
    while True:
        path = out.parent / f".{out.name}.fxshard-{tag}-{secrets.token_hex(4)}"
        if not create:
            if not os.path.lexists(path):
                return path
            continue
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


class _Stage:
    """The hidden sibling the new program is written into, and its journal: locked (``flock``) while this process
    lives, it says what the swap is doing, so that the next compile can finish or undo it after a ``kill -9``."""

    def __init__(self, out: Path):
        self.path = _sibling(out, "new")
        self.swapped = False
        try:
            self.fd = open_no_follow(self.path / JOURNAL, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644, "its journal")
        except BaseException:
            self.remove()
            raise
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # released by the kernel however this process ends
        self._note({"out": out.name, "state": "writing"})

    def _note(self, note: dict) -> None:
        data = json.dumps(note | {"pid": os.getpid()} | _machine()).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def swap_in(self, out: Path, foreign: set[str]) -> None:
        if not out.exists():
            self._note({"out": out.name, "state": "swapping", "old": None, "foreign": []})
            os.rename(self.path, out)
        else:
            old = self.path  # after the exchange the old folder has the stage's name
            exchange = _exchange_available()
            if not exchange:
                old = _sibling(out, "old", create=False)
            self._note({"out": out.name, "state": "swapping", "old": old.name, "foreign": sorted(foreign)})
            _stop_here("journaled")
            if not (exchange and _exchange(self.path, out)):
                if old == self.path:  # renameat2 refused (a filesystem without exchange): two renames
                    old = _sibling(out, "old", create=False)
                    self._note({"out": out.name, "state": "swapping", "old": old.name, "foreign": sorted(foreign)})
                os.rename(out, old)
                os.rename(self.path, out)
            self.swapped = True
            _stop_here("exchanged")
            _finish(out, old, foreign)
        self.swapped = True
        os.unlink(out / JOURNAL)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def close(self) -> None:
        os.close(self.fd)


def _finish(out: Path, old: Path, foreign: list[str] | set[str]) -> list[str]:
    """Move the user's files from the old folder (swapped out) into ``out``, then delete the old folder; the names
    moved.  Run again after a kill, it moves what is left."""
    moved = []
    for name in sorted(foreign):  # the user's files stay theirs
        src, dst = old / name, out / name
        if not os.path.lexists(src) or os.path.lexists(dst):
            continue
        try:
            os.rename(src, dst)
        except OSError as e:
            raise OutputFolderError(f"{out}: holds the new program, but moving your {name} back into it from {old} "
                                    f"failed ({e.strerror}); it is still there: move it into {out} yourself, then "
                                    f"delete {old}") from None
        moved.append(name)
    _stop_here("moved")
    shutil.rmtree(old)
    return moved


def _stop_here(point: str) -> None:
    if os.environ.get(STOP_ENV) == point:
        os.kill(os.getpid(), signal.SIGSTOP)


# ---------------------------------------------------------------- after a kill -9


def recover_interrupted(out: Path, kind: FolderKind) -> list[str]:
    """Finish or undo the swap of a write into ``out`` that was killed (its journal's lock is free), and warn
    what was done; the messages.  A write still running (its lock held) is refused, never touched; the lock is
    held through each recovery, so two compiles recovering at once do it once."""
    out = Path(out).resolve()
    messages = []
    if os.path.lexists(out / JOURNAL):
        with _claimed(out / JOURNAL, out, kind) as note:
            if note is not None:
                messages.append(_finish_swapped(out, note, kind))
    pattern = f".{glob.escape(out.name)}.fxshard-new-*"
    for sibling in sorted(out.parent.glob(pattern)):
        if not os.path.lexists(sibling / JOURNAL):
            if sibling.exists():
                messages.append(f"{sibling}: left by a {kind.verb} that an earlier fxshard did not finish; it may "
                                f"hold your files: move them into {out}, then delete it")
            continue
        with _claimed(sibling / JOURNAL, out, kind) as note:
            if note is None:  # another compile recovered it while this one waited
                continue
            old = _named_sibling(out, note.get("old"))
            if note.get("state") == "swapping" and not out.exists() and old is not None and old.is_dir():
                os.rename(sibling, out)  # killed between the two renames of a swap without exchange: complete it
                messages.append(_finish_swapped(out, note, kind))
                continue
            shutil.rmtree(sibling)
            messages.append(f"removed {sibling.name}: the staging folder of a {kind.verb} killed before it "
                            f"replaced {out}; {out} is as it was")
    for message in messages:
        warn(message)
    return messages


@contextlib.contextmanager
def _claimed(journal: Path, out: Path, kind: FolderKind):
    """The journal of a dead write, its lock held for the recovery (None: another compile recovered it first), or
    a refusal while its writer lives."""
    try:
        fd = open_no_follow(journal, os.O_RDWR, what="a swap's journal")
    except FileNotFoundError:  # recovered (and removed) by another compile since it was listed
        yield None
        return
    try:
        if not _locked(fd):
            _wait_for_dead_writer(fd, journal, out, kind)
        try:  # a compile that recovered it while this one waited has removed it
            same = os.path.samestat(os.fstat(fd), os.stat(journal, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        yield _read(fd) if same else None
    finally:
        os.close(fd)


def _wait_for_dead_writer(fd: int, journal: Path, out: Path, kind: FolderKind) -> None:
    """The lock of a journal whose writer has ended, once the processes that still hold it let go (a child between
    its fork and its exec, a compile recovering it); a refusal while the writer lives, or after a few seconds."""
    note = _read(fd)
    pid = note.get("pid", "unknown")
    if not (isinstance(pid, int) and _this_machine(note) and _ended(pid)):
        where = f" on {note['host']}" if isinstance(note.get("host"), str) and not _this_machine(note) else ""
        raise OutputFolderError(f"{out}: another fxshard (pid {pid}{where}) is writing this {kind.noun} now; wait "
                                f"for it to finish, or choose another {kind.flag}")
    deadline = time.monotonic() + INHERITED_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if _locked(fd):
            return
    raise OutputFolderError(f"{out}: the fxshard (pid {pid}) that was writing this {kind.noun} has ended, but a "
                            f"process it started still holds its journal {journal} open ({INHERITED_WAIT_S:g} s "
                            f"waited; `fuser {journal}` names it): end that process, then run again")


def _machine() -> dict:
    """Where a pid means this process's numbering: the host, and the pid namespace (containers share a volume)."""
    found = {"host": socket.gethostname()}
    with contextlib.suppress(OSError):
        found["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    return found


def _this_machine(note: dict) -> bool:
    """Whether a journal's writer ran where its pid is this process's to look up (a journal without the fields:
    yes)."""
    here = _machine()
    return all(note.get(k, v) == v for k, v in here.items())


def _locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has: its files are closed; only its exit status waits)."""
    if not _alive(pid):
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _read(fd: int) -> dict:
    try:
        note = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except ValueError:
        return {}
    return note if isinstance(note, dict) else {}


def _named_sibling(out: Path, name) -> Path | None:
    """A journal's ``old`` folder, only if it is one of this folder's hidden siblings (a journal is a file anyone
    could edit: it never names a folder elsewhere to move from or delete)."""
    if not isinstance(name, str) or "/" in name or not name.startswith(f".{out.name}.fxshard-"):
        return None
    return out.parent / name


def _finish_swapped(out: Path, note: dict, kind: FolderKind) -> str:
    """``out`` holds the new program (the journal travelled with it): carry the user's files over, drop the old."""
    old = _named_sibling(out, note.get("old"))
    foreign = [f for f in note.get("foreign", []) if isinstance(f, str) and ".." not in Path(f).parts
               and not Path(f).is_absolute()]
    moved = _finish(out, old, foreign) if old is not None and old.is_dir() else []
    os.unlink(out / JOURNAL)
    said = f"moved your {', '.join(moved)} back into it from {old.name} and removed that" if moved else \
        "nothing of yours was left behind"
    return f"recovered {out}: a {kind.verb} killed while swapping had put its new {kind.noun} in place; {said}"


_RENAME_EXCHANGE = 2


def _exchange_available() -> bool:
    return libc.function("renameat2") is not None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where the call is unavailable or refused."""
    renameat2 = libc.function("renameat2")
    if renameat2 is None:
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), _RENAME_EXCHANGE)
    return rc == 0


# ---------------------------------------------------------------- a folder staged by its writer(s), put in place


def publish_folder(staged: Path, final: Path) -> None:
    """Put the complete folder ``staged`` in place as its sibling ``final`` (a checkpoint's ``step-N``): an earlier
    ``final`` is renamed out of the name first and deleted after, so the name always holds a complete folder."""
    old = None
    if os.path.lexists(final):  # saving a step again (--overwrite, or resumed before it): swap, then drop the old one
        old = final.with_name(f"{final.name}.old-{secrets.token_hex(4)}")
        os.rename(final, old)
    os.rename(staged, final)
    if old is not None:
        _delete(old)


def remove_folder(path: Path) -> None:
    """Delete the folder ``path`` of fxshard's own: renamed out of its name first (an ``OSError`` then leaves it
    whole), so a deletion cut short leaves nothing under the name."""
    gone = path.with_name(f"{path.name}.old-{secrets.token_hex(4)}")
    os.rename(path, gone)
    _delete(gone)


def _delete(path: Path) -> None:
    if path.is_symlink():  # renamed, never followed
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
