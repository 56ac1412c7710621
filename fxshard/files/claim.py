"""The one path every write takes: check the names it will replace, write temporaries, then rename them in place.

:class:`Claim` checks its files when it is made (before the work: a refusal costs nothing) and again when it
publishes them (a file put there since is refused too), under the folder's lock, after cleaning up what dead
writers left (:mod:`fxshard.files.owned`).  Its members are one file (:func:`fxshard.files.write_bytes`) or a set
that switches together (:class:`fxshard.files.FileSet`)::

    claim = Claim({Path("d/x.bin"): "a token file's ids"})
    tmp, fd = new_temp(Path("d/x.bin")) ...                 # written, then:
    claim.publish({Path("d/x.bin"): tmp})
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from pathlib import Path

from fxshard.errors import warn
from fxshard.files.owned import Record, UnsafePathError, clean_stale, folder_lock, refuse_link

KILL_ENV = "FXSHARD_TEST_KILL_IN_SWITCH"  # tests: SIGKILL itself after this many renames of a set's switch


class Claim:
    """Writing ``members`` (path -> what fxshard writes there), all in one folder.  ``owner``: the record of a folder
    fxshard owns whole that vouches for these names (a checkpoint's index, a compile's manifest), or None: a folder
    the user shares, whose ``.fxshard-files.json`` must list every file replaced (and will list the new ones)."""

    def __init__(self, members: dict[Path, str], owner: str | None = None):
        self.members = {Path(p): w or "a file" for p, w in members.items()}
        folders = {p.parent for p in self.members}
        assert len(folders) == 1, f"a claim's files share one folder: {sorted(map(str, folders))}"
        self.folder = folders.pop()
        self.owner = owner
        for path, what in self.members.items():
            _not_a_link_or_folder(path, what)
        self._checked(lambda record: None)

    def _checked(self, then, check: bool = True):
        """Under the folder's lock: clean up after dead writers, check every member (``check``), then
        ``then(record)``."""
        if not self.folder.is_dir():
            raise UnsafePathError(f"{self.folder}: no such folder, where fxshard writes "
                                  f"{next(iter(self.members.values()))}; create it first")
        with folder_lock(self.folder):
            if self.owner is not None:
                clean_stale(self.folder)
                for path, what in self.members.items():
                    _not_a_link_or_folder(path, what)
                return then(None)
            record = Record.load(self.folder)
            if record.switching:  # first: the temporaries it names are complete, not stale
                done = record.finish_switch()
                record.save()
                if done:
                    warn(f"{self.folder}: finished putting {', '.join(done)} in place, which an fxshard killed while "
                         "switching a set of files had left half done")
            clean_stale(self.folder)
            for path, what in self.members.items() if check else ():
                record.check(path, what)
            return then(record)

    def publish(self, written: dict[Path, Path], fsync_folder: bool = False) -> None:
        """Rename each member's temporary (``written``: path -> temporary) onto its name, in the members' order, and
        delete the members not written (an earlier write's file the new set no longer has)."""
        moves = [(written[p], p) for p in self.members if p in written]
        drops = [p for p in self.members if p not in written and os.path.lexists(p)]
        for tmp, _ in moves:  # a library wrote it by name: still the plain file we made, not a link put there
            if not stat.S_ISREG(os.lstat(tmp).st_mode):
                raise UnsafePathError(f"{tmp}: is no longer the plain file fxshard was writing; nothing was replaced")

        def switch(record: Record | None) -> None:
            if record is not None:
                for tmp, path in moves:
                    record.note(path, os.stat(tmp), self.members[path])
                for path in drops:
                    record.forget(path.name)
                record.switching = [[t.name, p.name] for t, p in moves] if len(moves) + len(drops) > 1 else []
                record.save()
            for done, (tmp, path) in enumerate(moves):
                if os.environ.get(KILL_ENV) == str(done):
                    os.kill(os.getpid(), signal.SIGKILL)
                os.replace(tmp, path)  # replaces the name: a link planted there is replaced, never followed
            for path in drops:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if fsync_folder:
                _fsync_folder(self.folder)
            if record is not None and record.switching:
                record.switching = []
                record.save()

        self._checked(switch)

    def note_created(self, path: Path, fd: int, appends: bool = True) -> None:
        """A log opened in place (no rename): record it as fxshard's, by its inode."""
        if self.owner is not None:
            return

        def note(record: Record) -> None:
            record.note(path, os.fstat(fd), self.members[path], appends=appends)
            record.save()

        self._checked(note, check=False)


def _not_a_link_or_folder(path: Path, what: str) -> None:
    refuse_link(path, what)
    if path.is_dir():
        raise UnsafePathError(f"{path}: is a folder where fxshard writes {what}; move it away, or write {what} "
                              "elsewhere")


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
