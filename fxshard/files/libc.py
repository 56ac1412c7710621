"""The C library's functions fxshard calls directly (``renameat2``, ``prctl``), found without starting a process.

``ctypes.util.find_library("c")`` runs ``/sbin/ldconfig -p`` on Linux: a forked child that holds a copy of every
descriptor this process has open until it execs.  A compile killed (``kill -9``) in that window left its swap's
journal locked by that child, and the next compile said "another fxshard (pid N) is writing" of a dead N.  The
symbols already loaded into this process (``dlopen(NULL)``) include the C library, with no process started.
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def libc() -> ctypes.CDLL | None:
    """This process's C library (``errno`` kept for ``ctypes.get_errno``), or None where there is none to load."""
    if sys.platform == "win32":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def function(name: str):
    """The C library's function ``name``, or None where this platform has none (macOS has no ``renameat2``)."""
    lib = libc()
    return None if lib is None else getattr(lib, name, None)
