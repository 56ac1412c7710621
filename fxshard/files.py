"""Every file fxshard writes is written here, and never through a symbolic link planted where it goes.

A file is written whole into a new temporary file beside its name (opened ``O_CREAT | O_EXCL | O_NOFOLLOW``:
nothing already there is ever opened), then renamed onto the name.  A reader sees the old file or the new
one, never half of one; and since a rename replaces a name rather than writing through it, a link planted at
the name is never followed.  fxshard refuses such a link by name rather than silently replacing it: someone
put it there, and the user should know.  A file that stays open (a lock, an appended log) is opened with
``O_NOFOLLOW`` and refused the same way::

    write_text(Path("out/report.html"), page)        # UnsafePathError if out/report.html is a link
    fd = open_no_follow(Path("ckpt/.lock"), os.O_RDWR | os.O_CREAT)
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from fxshard.errors import FxshardError


class UnsafePathError(FxshardError):
    """A path fxshard would write is a symbolic link (or a folder) where a file belongs."""


def refuse_link(path: str | Path, what: str = "") -> None:
    """Raise :class:`UnsafePathError` naming ``path`` (and ``what`` fxshard writes there) when it is a link."""
    path = Path(path)
    if path.is_symlink():
        target = os.readlink(path)
        raise UnsafePathError(f"{path}: is a symbolic link (to {target}) where fxshard writes {what or 'a file'}; "
                              "fxshard never writes through a link. Remove the link (or write elsewhere)")


def write_bytes(path: str | Path, data: bytes, what: str = "", fsync: bool = False) -> Path:
    """Write ``data`` as the file ``path`` (temporary file in the same folder, then a rename); its path.

    ``fsync``: the bytes are on disk before the rename (a checkpoint's index, whose presence says the
    checkpoint is complete)."""
    path = Path(path)
    refuse_link(path, what)
    if path.is_dir():
        raise UnsafePathError(f"{path}: is a folder where fxshard writes {what or 'a file'}; move it away")
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces the name: a link planted since the check above is replaced, not followed
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: str | Path, text: str, what: str = "", fsync: bool = False) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"), what, fsync)


def open_no_follow(path: str | Path, flags: int, mode: int = 0o644, what: str = "") -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (``O_NOFOLLOW``), by name: for files kept open
    (a lock) or appended to, which a rename cannot write."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP or Path(path).is_symlink():
            refuse_link(path, what)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # a hard link writes into another name's file as well
        os.close(fd)
        found = "a hard link (one file with several names)" if stat.S_ISREG(st.st_mode) else "not a plain file"
        raise UnsafePathError(f"{path}: is {found} where fxshard writes {what or 'a file'}; fxshard writes only a "
                              "file of its own there. Remove it (or write elsewhere)")
    os.set_blocking(fd, True)
    return fd
