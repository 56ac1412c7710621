"""The one way fxshard writes a file a user can see.  Every command writes through these functions, and
``tests/test_one_writer.py`` fails on any other write in fxshard's source (``open(..., "w")``, ``Path.write_text``,
``torch.save``, ``save_file``, ``json.dump`` to a file, ``shutil.copy``, a rename ...), unless its allow-list says
why a library must write by itself (and then it writes a path this module staged).

Every write keeps four rules:

1. **Whole or not at all.**  A file is written into a new temporary beside its name (``.NAME.fxshard-PID-TAG.tmp``,
   created ``O_EXCL | O_NOFOLLOW``) and renamed onto the name: a reader sees the old file or the new one, and a
   failed write leaves the old one.  Files that belong together switch together (:class:`FileSet`).
2. **Never through a link.**  A symbolic link where the file goes is refused by name (a rename would replace it, but
   someone put it there and the user should know); so is one where fxshard makes a folder (:func:`make_folder`:
   ``data generate OUT`` refuses a linked ``OUT/tokenizer``).  A file kept open (a lock, a log) refuses a hard link.
3. **Only fxshard's files are replaced.**  In a folder the user shares with fxshard, its record
   ``.fxshard-files.json`` lists what fxshard wrote there, as what (``"a token file's index"``), with each file's
   size and modification time; a file it does not list, lists as another kind, or that changed since is refused by
   name (:mod:`fxshard.files.owned`).  A folder fxshard owns whole has a record of its own, which the write names as
   ``owner``: a compiled folder's manifest (``run.json``, ``report.html``), a checkpoint's index and steps, a
   staging folder (:data:`STAGE`, listed by the manifest written last).
4. **Nothing left behind.**  A temporary is locked (``flock``) by its writer; the next write into the folder
   removes those whose writer died (``kill -9``), and finishes a set switch it cut short.

The calls, by what is written::

    write_text(path, text, "the run record")                        # a whole file (write_bytes: bytes)
    with open_writing(path, "a trace") as f: f.write(part)          # a whole file, in pieces
    with path_for_library(path, "a shard", owner=STEP) as tmp:      # a library writes by name (torch.save,
        save_file(tensors, str(tmp))                                #   safetensors, DCP into a staged folder)
    with FileSet({bin_: "a token file's ids", idx: "a token file's index", side: "a token file's sidecar"}) as s:
        ...                                                         # several files, switched together at the end
    f = open_log(path, "the run's metrics", append=False)           # appended to while a run goes (by inode)
    make_folder(out / "tokenizer", "the tokenizer folder")          # a folder fxshard names: never a link
    with staged_output(out, names, PROGRAM) as stage: ...           # a folder written whole and swapped in
    publish_folder(staged, final); remove_folder(old)               # a checkpoint step put in place, deleted
    fd = open_no_follow(path, flags, what="the checkpoint's lock")  # a lock or journal kept open
    check_replaceable(path, what); try_writing(path, what)          # before a run: what a later write refuses

``what`` names the file in every refusal and keys the record: pass the same words wherever one kind of file is
written.  Refusals are :class:`UnsafePathError` (a link, a folder) and :class:`ForeignFileError` (not fxshard's).
"""

from fxshard.files.owned import RECORD, ForeignFileError, UnsafePathError, clean_stale, refuse_link
from fxshard.files.sets import FileSet
from fxshard.files.single import (
    check_replaceable,
    make_folder,
    open_log,
    open_no_follow,
    open_writing,
    path_for_library,
    try_writing,
    write_bytes,
    write_text,
)
from fxshard.files.staged import (
    JOURNAL,
    STAGE,
    FolderKind,
    Interrupted,
    check_target,
    publish_folder,
    recover_interrupted,
    remove_folder,
    staged_output,
)

__all__ = ["RECORD", "JOURNAL", "STAGE", "FileSet", "FolderKind", "ForeignFileError", "Interrupted", "UnsafePathError",
           "check_replaceable", "check_target", "clean_stale", "make_folder", "open_log", "open_no_follow",
           "open_writing", "path_for_library", "publish_folder", "recover_interrupted", "refuse_link", "remove_folder",
           "staged_output", "try_writing", "write_bytes", "write_text"]
