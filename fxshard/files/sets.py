"""Several files that belong together (a token file's ``.bin``, ``.idx`` and ``.json``) written as one: all staged,
then all renamed in place at the end, so a failed write leaves the old set whole and a reader never pairs a new
member with an old one.  A member the new write does not write (an optional sidecar) is deleted with the switch, so
no earlier write's file outlives its set.

The members are a dict of path -> what fxshard writes there; adding a member is one line::

    members = {prefix.with_suffix(".bin"): "a token file's ids",
               prefix.with_suffix(".idx"): "a token file's index",
               prefix.with_suffix(".json"): "a token file's sidecar"}
    with FileSet(members) as staged:                   # every member checked here, before any work
        with staged.open(prefix.with_suffix(".bin")) as f:
            f.write(ids)                               # streamed into the member's temporary
        staged.write(prefix.with_suffix(".idx"), index)              # bytes, or text (UTF-8)
        staged.write(prefix.with_suffix(".json"), sidecar)           # the member that vouches for the rest: last
    # here all three are in place; had the block raised, none would have moved

The renames are not one atomic step: a ``kill -9`` between two of them is finished by the next write into the
folder (the record says which temporaries were switching, all complete), and a reader of a half-switched set finds
members that do not pair (the token file's sidecar records its members' sizes).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from fxshard.files.claim import Claim
from fxshard.files.owned import new_temp


class FileSet:
    """Stage ``members`` (path -> what), switch them together on a clean exit (see the module docstring)."""

    def __init__(self, members: dict[Path, str], owner: str | None = None):
        self.members = {Path(p): w for p, w in members.items()}
        self.owner = owner
        self._claim: Claim | None = None
        self._temps: dict[Path, tuple[Path, int]] = {}

    def __enter__(self) -> FileSet:
        self._claim = Claim(self.members, self.owner)
        return self

    def _temp(self, path: Path) -> Path:
        path = Path(path)
        if path not in self.members:
            raise KeyError(f"{path} is not a member of this set ({', '.join(p.name for p in self.members)})")
        if path not in self._temps:
            self._temps[path] = new_temp(path)
        return self._temps[path][0]

    @contextlib.contextmanager
    def open(self, path: Path):
        """A binary file object on member ``path``'s temporary."""
        self._temp(path)
        with os.fdopen(self._temps[Path(path)][1], "wb", closefd=False) as f:
            yield f

    def write(self, path: Path, data: bytes | str) -> None:
        """Member ``path`` whole: ``data`` (text is written in UTF-8)."""
        with self.open(path) as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)

    def path(self, path: Path) -> Path:
        """Member ``path``'s temporary, for a library that writes a file by name."""
        return self._temp(path)

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None:
                from fxshard.files.single import keep_mode

                for tmp, fd in self._temps.values():
                    keep_mode(tmp, fd)
                self._claim.publish({p: t for p, (t, _) in self._temps.items()})
        finally:
            for tmp, fd in self._temps.values():
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)  # published: renamed away already
