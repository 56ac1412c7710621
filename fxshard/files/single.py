"""One file, written whole beside its name and renamed onto it; a log appended to in place; a folder of fxshard's.

See :mod:`fxshard.files` for the rules every one of these keeps; this module is their single-file half::

    write_text(Path("out/report.html"), page, "the report")
    with open_writing(Path("data/ids.bin"), "a token dump") as f: f.write(chunk)
    with path_for_library(Path("ckpt/shard.safetensors"), "a shard", owner="the step") as tmp:
        save_file(tensors, str(tmp))            # the library writes the temporary; it is renamed on success
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from fxshard.files.claim import Claim
from fxshard.files.owned import UnsafePathError, new_temp, refuse_link


def write_bytes(path: str | Path, data: bytes, what: str = "", fsync: bool = False, *, owner: str | None = None
                ) -> Path:
    """Write ``data`` as the file ``path``; its path.  ``fsync``: the bytes (and the rename) are on disk before this
    returns (a checkpoint's index, whose presence says the checkpoint is complete).  ``owner``: see :class:`Claim`."""
    with open_writing(path, what, fsync, owner=owner) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str, what: str = "", fsync: bool = False, *, owner: str | None = None
               ) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"), what, fsync, owner=owner)


@contextlib.contextmanager
def open_writing(path: str | Path, what: str = "", fsync: bool = False, *, owner: str | None = None):
    """A binary file object on ``path``'s temporary, for a file written in pieces; renamed onto ``path`` when the
    block ends cleanly, removed if it raises (``path`` is then as it was)."""
    path = Path(path)
    claim = Claim({path: what}, owner)
    tmp, fd = new_temp(path)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(fd)
        claim.publish({path: tmp}, fsync_folder=fsync)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def path_for_library(path: str | Path, what: str = "", fsync: bool = False, *, owner: str | None = None):
    """The temporary's path, for a library that writes a file by name (``torch.save``, safetensors' ``save_file``):
    it writes the new, empty file fxshard made; renamed onto ``path`` when the block ends cleanly."""
    path = Path(path)
    claim = Claim({path: what}, owner)
    tmp, fd = new_temp(path)
    try:
        yield tmp
        keep_mode(tmp, fd)
        if fsync:
            _fsync(tmp)
        claim.publish({path: tmp}, fsync_folder=fsync)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


def open_log(path: str | Path, what: str, append: bool):
    """A file fxshard appends lines to as it runs (``--metrics``): opened in place without following a link (nor a
    hard link), refused when it exists and fxshard did not write it; emptied unless ``append``.  A text file object
    (UTF-8) appending to it."""
    path = Path(path)
    claim = Claim({path: what})
    fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644, what)
    try:
        claim.note_created(path, fd)
        if not append:
            os.ftruncate(fd, 0)  # after the checks: never a file the name only led to
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


def try_writing(path: str | Path, what: str, *, owner: str | None = None) -> None:
    """Before a run: everything a later write of ``path`` would refuse (a link, a folder, a file fxshard did not
    write), and the kernel's own answer: a temporary can be made beside it, and an existing file opened to append
    (a log appends in place).  An ``OSError`` says why not; nothing is left behind."""
    path = Path(path)
    Claim({path: what}, owner)
    tmp, fd = new_temp(path)
    os.close(fd)
    os.unlink(tmp)
    if path.exists():
        os.close(open_no_follow(path, os.O_WRONLY | os.O_APPEND, what=what))


def check_replaceable(path: str | Path, what: str, *, owner: str | None = None) -> None:
    """Refuse now what a later write of ``path`` as ``what`` would refuse: a link, a folder, a file not fxshard's."""
    Claim({Path(path): what}, owner)


def open_no_follow(path: str | Path, flags: int, mode: int = 0o644, what: str = "") -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (``O_NOFOLLOW``), by name, and a hard link: for files kept
    open (a lock, a journal) that a rename cannot write.  (Its ownership is the caller's: see :func:`open_log`.)"""
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


def make_folder(path: str | Path, what: str, parents: bool = True) -> Path:
    """Create the folder ``path`` that fxshard names itself (``OUT/tokenizer``, a ``--trace`` folder), or take it as it
    is; a symbolic link there is refused: fxshard would write into its target, somewhere the user did not name."""
    path = Path(path)
    refuse_link(path, what)
    if path.exists() and not path.is_dir():
        raise UnsafePathError(f"{path}: is a file where fxshard makes {what} (a folder); move it away, or choose "
                              "another path")
    path.mkdir(parents=parents, exist_ok=True)
    refuse_link(path, what)  # planted between the check and the mkdir, which then found it "existing"
    return path


def keep_mode(tmp: Path, fd: int) -> None:
    """A library that wrote ``tmp`` by way of its own temporary (safetensors renames a 0600 file onto the name) gets
    the permissions of the file fxshard made, a new file's under the umask: a checkpoint others could read stays
    readable."""
    with contextlib.suppress(FileNotFoundError):
        mine, found = os.fstat(fd), os.lstat(tmp)
        if stat.S_ISREG(found.st_mode) and found.st_ino != mine.st_ino:  # a link there is refused when published
            os.chmod(tmp, stat.S_IMODE(mine.st_mode))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
