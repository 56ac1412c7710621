"""Read and validate a compiled output folder (``manifest.json``, rank files, weights)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from fxshard.errors import OutputFolderError
from fxshard.ir.context import Layout

MANIFEST = "manifest.json"
FORMAT = 1


def read_manifest(out: str | Path) -> dict:
    """The manifest of an fxshard output folder, after checking the folder is one."""
    out = Path(out)
    path = out / MANIFEST
    if not out.is_dir():
        raise OutputFolderError(f"{out}: no such folder; compile first with `fxshard compile MODEL.py --out {out}`")
    if not path.is_file():
        raise OutputFolderError(f"{out}: not an fxshard output folder (no {MANIFEST}); "
                                f"compile into it with `fxshard compile MODEL.py --out {out}`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise OutputFolderError(f"{path}: not valid JSON ({e}); recompile") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "ranks" not in manifest:
        raise OutputFolderError(f"{path}: not an fxshard manifest of format {FORMAT}; recompile with this fxshard")
    for i, entry in enumerate(manifest["ranks"]):
        for key in ("file", "weights"):
            if not inside(out, entry[key], f"ranks[{i}].{key}", path).is_file():
                raise OutputFolderError(f"{out}: {entry[key]} listed in the manifest is missing; recompile")
    if not inside(out, manifest["model_file"], "model_file", path).is_file():
        raise OutputFolderError(f"{out}: {manifest['model_file']} (the copied model file) is missing; recompile")
    return manifest


def inside(folder: Path, name, key: str, where: Path, error: type[Exception] = OutputFolderError) -> Path:
    """``folder / name`` with symlinks resolved, refused unless it stays inside ``folder``.

    Every reader of a manifest or checkpoint index goes through here: those files are plain JSON anyone
    can edit, and a path such as ``../../etc/passwd`` must not make ``show`` print or ``run`` execute it."""
    if not isinstance(name, str) or not name:
        raise error(f"{where}: {key} is {name!r}; expected a file name relative to {folder}")
    root = Path(folder).resolve()
    path = (root / name).resolve()
    if Path(name).is_absolute() or not path.is_relative_to(root):
        raise error(f"{where}: {key} is {name!r}, which resolves to {path}, outside {folder}; a manifest or "
                    "checkpoint index may only name files inside its own folder. Recompile (or save the checkpoint "
                    "again) rather than editing its paths")
    return path


def is_fxshard_manifest(path: Path) -> dict | None:
    """The manifest at ``path`` if fxshard wrote it (format, version and rank list), else None."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if (isinstance(manifest, dict) and manifest.get("format") == FORMAT and "fxshard_version" in manifest
            and isinstance(manifest.get("ranks"), list) and isinstance(manifest.get("model_file"), str)):
        return manifest
    return None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def edited_files(out: Path, manifest: dict) -> list[str]:
    """The generated files (rank files, model.py) whose sha256 differs from the one recorded at compile.

    Weights are not digested: they are data (safetensors runs no code), can be many GB to hash on every
    run, and ``check`` already compares each shard's tensors and shapes with the code."""
    digests = manifest.get("digests")
    if not isinstance(digests, dict):
        return ["manifest.json (it records no file digests: compiled by an older fxshard)"]
    names = [e["file"] for e in manifest["ranks"]] + [manifest["model_file"]]
    return [n for n in names
            if digests.get(n) != file_digest(inside(out, n, f"digests[{n!r}]", out / MANIFEST))]


def refuse_edited(out: Path, manifest: dict) -> None:
    edited = edited_files(Path(out), manifest)
    if edited:
        verb = "differs" if len(edited) == 1 else "differ"
        raise OutputFolderError(f"{out}: {', '.join(edited)} {verb} from what fxshard compile wrote (sha256 in "
                                "manifest.json): edited after compile. Recompile, or pass --allow-edited to run "
                                "the edited files anyway")


def layout_of(manifest: dict) -> Layout:
    return Layout.from_json(manifest["layout"])


def rank_entry(manifest: dict, coords: dict[str, int]) -> dict:
    for entry in manifest["ranks"]:
        if all(entry["coords"][k] == coords[k] for k in ("pp", "tp")):
            return entry
    raise OutputFolderError(f"no rank file for coordinates {coords} in the manifest; recompile")


def import_rank_file(path: str | Path):
    """Import a generated rank file as a module."""
    path = Path(path).resolve()
    name = "fxshard_rank_" + str(abs(hash(str(path))))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise OutputFolderError(f"{path}: the rank file does not import ({type(e).__name__}: {e}); recompile") from e
    return module
