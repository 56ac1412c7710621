"""The compiled program's folder: what :func:`fxshard.files.staged_output` needs to replace one (its record is the
manifest, which lists every file the compile wrote; ``weights/`` is fxshard's folder, listed file by file).

The staging, the swap and the recovery after a ``kill -9`` are the writer's (:mod:`fxshard.files.staged`), shared
with ``fxshard export``; the three calls below are the writer's with the program's kind as their default::

    with staged_output(Path("out/gpt"), names) as stage:
        write_text(stage / "manifest.json", manifest.dumps(), "the manifest", owner=STAGE)
"""

from __future__ import annotations

from pathlib import Path

from fxshard.codegen.manifest import MANIFEST, listed_files
from fxshard.files import staged
from fxshard.files.staged import JOURNAL, STAGE, STOP_ENV, FolderKind, Interrupted  # noqa: F401  (the compile's names)

PROGRAM = FolderKind("output", "program", "compile", "--out", MANIFEST, listed_files, ("weights",))
OUT_OWNER = "the compiled folder"  # owner (fxshard.files) of what fxshard writes into one after it: run.json, report


def staged_output(out: Path, new_names: set[str], kind: FolderKind = PROGRAM):
    """:func:`fxshard.files.staged_output` of a compiled program (or ``kind``)."""
    return staged.staged_output(out, new_names, kind)


def check_target(out: Path, new_names: set[str], kind: FolderKind = PROGRAM) -> set[str]:
    """:func:`fxshard.files.check_target` of a compiled program (or ``kind``)."""
    return staged.check_target(out, new_names, kind)


def recover_interrupted(out: Path, kind: FolderKind = PROGRAM) -> list[str]:
    """:func:`fxshard.files.recover_interrupted` of a compiled program (or ``kind``)."""
    return staged.recover_interrupted(out, kind)
