"""Which files of a folder fxshard wrote: the folder's record ``.fxshard-files.json``, and its stale temporaries.

A folder a user shares with fxshard (``data/`` holding a token file, the folder of a ``--metrics`` file or a
calibrated profile) may hold anything; fxshard replaces a file there only if its record lists it, as the same kind
of file (``what``: a token file's index is never replaced as a report), and the file is still what fxshard wrote:
its size and modification time (in nanoseconds) are the ones recorded, so a file the user edited or put in its
place since is theirs.  (A log fxshard appends to, the metrics, is recorded by its inode: it grows.)  The record is
updated before the rename that puts a new file in place, keeping the identity of the file it replaces beside the
new one, so a ``kill -9`` between the two never makes a file of fxshard's look foreign::

    {"format": "fxshard-files/1",
     "files": {"corpus.bin": {"what": "a token file's ids", "ids": [[52428800, 1718000000123456789]]}},
     "switching": [[".corpus.bin.fxshard-4242-a1b2c3d4.tmp", "corpus.bin"], ...]}   # only while a set switches

Every update holds ``flock`` on the folder itself (so two writers in one folder take turns), and every holder first
cleans up after writers that died: temporaries ``.NAME.fxshard-PID-TAG.tmp`` whose ``flock`` (held by their writer
while it writes) is free, and a set switch the record says was under way (its new files were complete: the switch is
finished).  Folders fxshard owns whole (a compiled folder, a checkpoint's steps, a staging folder) have records of
their own (the manifest, the index); their writes name that ``owner`` and skip this one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path

from fxshard.errors import FxshardError

RECORD = ".fxshard-files.json"
FORMAT = "fxshard-files/1"
TEMP = re.compile(r"^\.(?P<name>.+)\.fxshard-(?P<pid>\d+)-[0-9a-f]+\.tmp$")
ORPHAN_SECONDS = 60.0  # a free temporary this old is stale even if a process with its writer's pid runs (reused)


class UnsafePathError(FxshardError):
    """A path fxshard would write is a symbolic link (or a folder) where a file belongs."""


class ForeignFileError(UnsafePathError):
    """A file fxshard would replace is not one fxshard wrote (or not as this kind of file, or changed since)."""


def temp_path(path: Path) -> Path:
    """A new temporary's name beside ``path``: hidden, naming the file and this process (stale ones are found by it)."""
    return path.with_name(f".{path.name}.fxshard-{os.getpid()}-{secrets.token_hex(4)}.tmp")


def new_temp(path: Path) -> tuple[Path, int]:
    """Create ``path``'s temporary (``O_EXCL | O_NOFOLLOW``: nothing already there is opened) and lock it for as long
    as this process writes it; its name and descriptor."""
    while True:
        tmp = temp_path(path)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        with contextlib.suppress(OSError):  # a filesystem without flock: temporaries are then found by pid alone
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return tmp, fd


def identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns]


@contextlib.contextmanager
def folder_lock(folder: Path):
    """Hold ``flock`` on ``folder`` for the block (where the filesystem has it: elsewhere the block runs unlocked)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Record:
    """The files fxshard wrote in one folder (see the module docstring); read and changed under :func:`folder_lock`."""

    def __init__(self, folder: Path, files: dict, switching: list | None = None):
        self.folder, self.files, self.switching = folder, files, switching or []

    @classmethod
    def load(cls, folder: Path) -> Record:
        path = folder / RECORD
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise UnsafePathError(f"{path}: is not a plain file; fxshard keeps the list of the files it wrote in "
                                  f"{folder} there. Remove it")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: nothing in the folder counts as fxshard's
            return cls(folder, {})
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return cls(folder, {})
        files = {k: v for k, v in (data.get("files") or {}).items() if isinstance(v, dict)}
        switching = [m for m in data.get("switching") or () if isinstance(m, list) and len(m) == 2]
        return cls(folder, files, switching)

    def save(self) -> None:
        data = {"format": FORMAT, "files": dict(sorted(self.files.items()))}
        if self.switching:
            data["switching"] = self.switching
        tmp, fd = new_temp(self.folder / RECORD)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data, indent=1) + "\n")
            os.replace(tmp, self.folder / RECORD)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def check(self, path: Path, what: str) -> None:
        """Refuse to replace ``path`` unless it is absent or fxshard wrote it there as ``what``, unchanged since."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        refuse_link(path, what)
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"{path}: is a folder where fxshard writes {what}; move it away, or write "
                                  f"{what} elsewhere")
        entry = self.files.get(path.name)
        where = f"{self.folder / RECORD}, the list of the files fxshard wrote in {self.folder}"
        if entry is None:
            raise ForeignFileError(f"{path}: exists, and fxshard did not write it (it is not in {where}); fxshard "
                                   f"replaces only its own files. Move it away, or write {what} elsewhere")
        if entry.get("what") != what:
            raise ForeignFileError(f"{path}: fxshard wrote it as {entry.get('what')}, not as {what}; writing here "
                                   f"would replace it. Write {what} elsewhere (or delete the file first)")
        ours = st.st_ino == entry.get("ino") if entry.get("appends") else identity(st) in entry.get("ids", [])
        if not ours:
            raise ForeignFileError(f"{path}: changed since fxshard wrote it (its size or modification time is not "
                                   f"the one {where} has), so it may hold your edits; move it away, or write {what} "
                                   "elsewhere")

    def note(self, final: Path, written: os.stat_result, what: str, appends: bool = False) -> None:
        """Record ``written`` (the new file, still under its temporary name, or a log just created) as ``final``,
        keeping the identity of the file it replaces until the next write (the rename may not happen)."""
        entry: dict = {"what": what}
        if appends:
            entry |= {"appends": True, "ino": written.st_ino}
        else:
            old = self.files.get(final.name, {}).get("ids", [])[:1]
            entry["ids"] = [identity(written)] + [i for i in old if i != identity(written)]
        self.files[final.name] = entry

    def forget(self, name: str) -> None:
        self.files.pop(name, None)

    def finish_switch(self) -> list[str]:
        """A set switch that its writer did not finish (it died holding the lock that the caller holds now): every
        new file was complete before it started, so it is finished; the names it put in place."""
        done = []
        for tmp, final in self.switching:
            if "/" in tmp or "/" in final or not TEMP.match(tmp):  # a record is a file anyone could edit
                continue
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.folder / tmp, self.folder / final)
                done.append(final)
        self.switching = []
        return done


def refuse_link(path: str | Path, what: str = "") -> None:
    """Raise :class:`UnsafePathError` naming ``path`` (and ``what`` fxshard writes there) when it is a link."""
    path = Path(path)
    if path.is_symlink():
        target = os.readlink(path)
        raise UnsafePathError(f"{path}: is a symbolic link (to {target}) where fxshard writes {what or 'a file'}; "
                              "fxshard never writes through a link. Remove the link (or write elsewhere)")


def clean_stale(folder: Path) -> list[str]:
    """Remove the temporaries of writers that died (``kill -9``) in ``folder``; the names removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = TEMP.match(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        if _stale(Path(entry.path), int(m["pid"])):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


def _stale(tmp: Path, pid: int) -> bool:
    """Its writer is gone: its lock is free, and no process has its pid (or the file is older than a writer's
    first instant, between creating it and locking it)."""
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer is writing it
        except OSError:
            pass
        if pid == os.getpid():
            return False
        return not _alive(pid) or time.time() - os.fstat(fd).st_mtime > ORPHAN_SECONDS
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as e:
        return e.errno == errno.EPERM
    return True
