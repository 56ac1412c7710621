"""The compiled program's folder: what :func:`fxshard.files.staged_output` needs to replace one (its record is the
manifest, which lists every file the compile wrote; ``weights/`` is fxshard's folder, listed file by file).

The staging, the swap and the recovery after a ``kill -9`` are the writer's (:mod:`fxshard.files.staged`), shared
with ``fxshard export``; the names below are that module's, for the compile and the tests that drive it::

    with staged_output(Path("out/gpt"), names, PROGRAM) as stage:
        write_text(stage / "manifest.json", manifest.dumps(), "the manifest", owner=STAGE)
"""

from __future__ import annotations

from fxshard.codegen.manifest import MANIFEST, listed_files
from fxshard.files.staged import (  # noqa: F401  (the compile's and the tests' names for the writer's parts)
    JOURNAL,
    STAGE,
    STOP_ENV,
    FolderKind,
    Interrupted,
    check_target,
    recover_interrupted,
    staged_output,
)

PROGRAM = FolderKind("output", "program", "compile", "--out", MANIFEST, listed_files, ("weights",))
OUT_OWNER = "the compiled folder"  # owner (fxshard.files) of what fxshard writes into one after it: run.json, report
