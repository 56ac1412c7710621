"""fxshard writes a file a user can see only through ``fxshard.files`` (issue 45): this reads every module of the
package (fxshard/, passes/, cli/) and fails on any other way of writing one, naming the file, the line and the call.

What counts as a write: ``open()`` with a mode that writes (or a mode that is not a literal), ``os.open`` or
``os.fdopen`` with flags that write, ``Path.write_text`` / ``write_bytes`` / ``touch`` / ``symlink_to`` /
``rename`` / ``replace``, ``os.rename`` / ``os.replace`` / ``os.link`` / ``os.symlink``, ``shutil``'s copies and
moves, ``json.dump`` / ``pickle.dump`` to a file, ``torch.save``, safetensors' ``save_file`` / ``save_model``,
``save_pretrained``, numpy's ``save`` / ``tofile``, ``tempfile``'s files, ``torch.distributed.checkpoint``'s
``save``.  The writer's own package (fxshard/files/) is where these live, and a library that writes a file by name
writes the temporary ``fxshard.files.path_for_library`` staged (a call inside ``with path_for_library(...)``).
Anything else must be in :data:`ALLOWED`, with the reason a library writes by itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = (ROOT / "fxshard", ROOT / "passes", ROOT / "cli")
WRITER = ROOT / "fxshard" / "files"

# (file, call) -> why it may write by itself
ALLOWED = {
    ("fxshard/runtime/guard.py", "open(mode='w')"):
        "torch's elastic launcher reads a failed rank's message from the file it names (TORCHELASTIC_ERROR_FILE), in "
        "its own temporary log folder: torch's protocol, not a user's file (and the runtime imports torch alone)",
    ("fxshard/runtime/guard.py", "json.dump()"): "the same error file's JSON, into the handle above",
    ("fxshard/testing.py", ".write_bytes()"):
        "the test harness's own temporary folder (a rank's pickled result), never a user's path",
    ("fxshard/testing.py", ".write_text()"):
        "the test harness's own temporary folder (a process's CPU seconds), never a user's path",
    ("fxshard/testing.py", "os.open(write flags)"):
        "the test harness's own temporary folder: a forked command line's stdout and stderr",
    ("fxshard/train/export.py", ".save_pretrained()"):
        "transformers (and peft, for --peft) writes the model's files by itself, into the export's staging folder "
        "(fxshard.files.staged), which the export's record then lists and the swap puts in place",
    ("fxshard/train/board.py", "SummaryWriter()"):
        "torch's SummaryWriter appends to its own event file while the run goes (a watching TensorBoard reads it "
        "live, so it cannot be staged and renamed at the end), in the --tensorboard folder fxshard.files.make_folder "
        "made (never a link), under a new name per run (time, host, process): it never opens another's file",
}

WRITE_MODES = set("wax+")
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
PATH_METHODS = {"write_text", "write_bytes", "touch", "symlink_to", "hardlink_to", "rename", "save_pretrained",
                "tofile", "to_csv", "to_parquet", "export_chrome_trace"}
MODULE_CALLS = {
    "os": {"rename", "replace", "link", "symlink", "renames"},
    "shutil": {"copy", "copy2", "copyfile", "copytree", "move", "copyfileobj"},
    "json": {"dump"}, "pickle": {"dump"}, "torch": {"save"}, "np": {"save", "savez", "savez_compressed", "savetxt"},
    "numpy": {"save", "savez", "savez_compressed", "savetxt"}, "tempfile": {"mkstemp", "NamedTemporaryFile"},
    "dcp": {"save", "async_save"}, "checkpoint": {"save", "async_save"},
}
BARE_CALLS = {"save_file", "save_model", "mkstemp", "NamedTemporaryFile", "copyfile", "copy2", "copytree",
              "SummaryWriter", "FileWriter"}


def _literal(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _names(node) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | \
        {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _write(call: ast.Call) -> str | None:
    """How ``call`` writes a file, or None."""
    f = call.func
    if isinstance(f, ast.Name) and f.id == "open":
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        if mode is None:
            return None
        text = _literal(mode)
        if text is None or WRITE_MODES & set(text):
            return f"open(mode={text!r})" if text is not None else "open(mode not a literal)"
        return None
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "os" and \
            f.attr in ("open", "fdopen"):
        flags = call.args[1] if len(call.args) > 1 else None
        if f.attr == "open" and flags is not None and WRITE_FLAGS & _names(flags):
            return "os.open(write flags)"
        if f.attr == "fdopen" and flags is not None and (WRITE_MODES & set(_literal(flags) or "w")):
            return "os.fdopen(write mode)"
        return None
    if isinstance(f, ast.Attribute):
        owner = f.value.id if isinstance(f.value, ast.Name) else None
        if owner in MODULE_CALLS and f.attr in MODULE_CALLS[owner]:
            return f"{owner}.{f.attr}()"
        if f.attr in PATH_METHODS:
            return f".{f.attr}()"
        if f.attr in BARE_CALLS:
            return f"{f.attr}()"
    if isinstance(f, ast.Name) and f.id in BARE_CALLS:
        return f"{f.id}()"
    return None


def _staged(tree: ast.AST) -> set[int]:
    """Lines inside ``with path_for_library(...)``: a library writes the temporary the writer made there."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
                isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", getattr(
                    i.context_expr.func, "attr", None)) == "path_for_library" for i in node.items):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
    return lines


def _found() -> list[tuple[str, int, str]]:
    found = []
    for folder in SCANNED:
        for path in sorted(folder.rglob("*.py")):
            if path.is_relative_to(WRITER):
                continue
            rel = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text(), str(path))
            staged = _staged(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and node.lineno not in staged:
                    how = _write(node)
                    if how is not None:
                        found.append((rel, node.lineno, how))
    return found


def test_every_file_fxshard_writes_goes_through_fxshard_files():
    other = [f"{rel}:{line}: {how}" for rel, line, how in _found() if (rel, how) not in ALLOWED]
    assert not other, ("files written another way than through fxshard.files (write them with its functions, or "
                       "add the call to ALLOWED with the reason a library must write by itself):\n  "
                       + "\n  ".join(other))


def test_every_allowed_write_is_still_there():
    """An allow-list entry whose call is gone is removed, so the list stays the exceptions there are."""
    seen = {(rel, how) for rel, _, how in _found()}
    assert not set(ALLOWED) - seen, f"allowed writes no longer in the source: {sorted(set(ALLOWED) - seen)}"


def test_the_scan_sees_each_kind_of_write(tmp_path):
    """The scan itself: each kind of write in a module is found (a scan that finds nothing proves nothing)."""
    source = '''
import json, os, shutil, torch
from safetensors.torch import save_file
open(p, "w"); open(p, mode="ab"); open(p, m)
os.open(p, os.O_WRONLY | os.O_CREAT); os.fdopen(fd, "w")
Path(p).write_text("x"); p.write_bytes(b""); p.rename(q); os.replace(p, q)
shutil.copyfile(p, q); json.dump({}, f); torch.save(t, p); save_file(t, p); model.save_pretrained(d)
open(p); open(p, "rb"); os.open(p, os.O_RDONLY)
with path_for_library(p, "a shard") as tmp:
    save_file(t, str(tmp))
'''
    tree = ast.parse(source)
    found = [_write(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno not in _staged(tree)]
    writes = [w for w in found if w is not None]
    assert writes == ["open(mode='w')", "open(mode='ab')", "open(mode not a literal)", "os.open(write flags)",
                      "os.fdopen(write mode)", ".write_text()", ".write_bytes()", ".rename()", "os.replace()",
                      "shutil.copyfile()", "json.dump()", "torch.save()", "save_file()", ".save_pretrained()"], writes
