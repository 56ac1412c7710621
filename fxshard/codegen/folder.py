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
import shutil
import tempfile
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
    out = Path(out)
    foreign = check_target(out, new_names)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.fxshard-new-", dir=out.parent))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _swap_in(stage, out, foreign)


def _swap_in(stage: Path, out: Path, foreign: set[str]) -> None:
    if not out.exists():
        os.rename(stage, out)
        return
    if _exchange(stage, out):  # one atomic step: out is the new program, stage holds the old folder
        old, trash = stage, stage
    else:
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.fxshard-old-", dir=out.parent))
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
