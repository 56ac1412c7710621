"""Read and validate a compiled output folder (``manifest.json``, rank files, weights)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from fxshard.errors import OutputFolderError
from fxshard.ir.context import Layout

MANIFEST = "manifest.json"
FORMAT = 1


def inside(folder: Path, name, what: str, error: type[Exception] = OutputFolderError) -> Path:
    """``folder / name``, after checking ``name`` leads to a place inside ``folder``: a relative path with no
    ``..`` or link that climbs out.  Every path a manifest or checkpoint index names goes through here, so a
    damaged or hostile one cannot make fxshard read, show or run a file elsewhere."""
    root = Path(folder).resolve()
    if not isinstance(name, str) or not name or Path(name).is_absolute() or \
            not (root / name).resolve().is_relative_to(root):
        raise error(f"{folder}: {what} is {name!r}, which lies outside the folder; a compiled folder and a "
                    "checkpoint name only files inside themselves — recompile (or re-save), and do not use a folder "
                    "from an untrusted source")
    return Path(folder) / name


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
    for entry in manifest["ranks"]:
        for key in ("file", "weights"):
            if not inside(out, entry.get(key), f"the manifest's rank {key!r}").is_file():
                raise OutputFolderError(f"{out}: {entry[key]} listed in the manifest is missing; recompile")
    if not inside(out, manifest.get("model_file"), "the manifest's 'model_file'").is_file():
        raise OutputFolderError(f"{out}: {manifest['model_file']} (the copied model file) is missing; recompile")
    return manifest


def layout_of(manifest: dict) -> Layout:
    lay = manifest["layout"]
    return Layout(tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], zero=lay["zero"], schedule=lay["schedule"],
                  microbatches=lay["microbatches"], virtual_stages=lay.get("virtual_stages"),
                  dtype=lay.get("dtype", "fp32"))


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
