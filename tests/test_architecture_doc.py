"""Tier 1: docs/architecture.md names every module of the package and every pass of the registry, and nothing that is
gone, as tests/test_layers.py places every module in a layer: a module added without a line there fails here.

The page has one section per package folder (``### `fxshard/ir/```; a small subpackage in its parent's, which names
it: ``hardware/``); a module is named by its file name in its folder's section (``layout.py``), a package's
``__init__.py`` only where it holds code of its own (the registry, the hardware profiles, ``open_batches``).  The
registry's passes appear, in its order, in the page's pass line (``token_mean → causal_attention → ...``) and in its
table of passes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fxshard.passes import PASSES

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
FOLDERS = ("fxshard", "passes", "cli")  # the package's sources (passes and cli install as fxshard.passes, .cli)


def _sections() -> dict[str, str]:
    """Folder (``fxshard/ir/``) -> the text of its section."""
    parts = re.split(r"^### `([\w/]+/)`\s*$", PAGE.read_text(), flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def _has_code(path: Path) -> bool:
    """Whether a package's ``__init__.py`` defines something beyond its docstring, imports and ``__all__``."""
    body = ast.parse(path.read_text()).body
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) or (isinstance(n, ast.Assign) and not any(
        getattr(t, "id", "") == "__all__" for t in n.targets)) for n in body)


def _modules() -> dict[str, list[str]]:
    """Folder -> the file names its section must name."""
    found: dict[str, list[str]] = {}
    for top in FOLDERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            folder = f"{path.parent.relative_to(ROOT)}/"
            if path.name != "__init__.py" or _has_code(path):
                found.setdefault(folder, []).append(path.name)
            else:
                found.setdefault(folder, [])
    return found


def _section(sections: dict[str, str], folder: str) -> str | None:
    """A folder's section, or for a small subpackage (``fxshard/cost/hardware/``) its parent's, which names it."""
    if folder in sections:
        return sections[folder]
    parent, _, name = folder.rstrip("/").rpartition("/")
    text = sections.get(f"{parent}/", "")
    return text if f"`{name}/`" in text else None


def test_every_module_is_named_in_its_folders_section():
    found, modules = _sections(), _modules()
    sections = {folder: _section(found, folder) for folder in modules}
    missing_sections = sorted(f for f, text in sections.items() if text is None)
    assert not missing_sections, f"docs/architecture.md has no section (### `folder/`) for {missing_sections}"
    unnamed = [f"{folder}{name}" for folder, names in modules.items() for name in names
               if not re.search(rf"(?<![\w/]){re.escape(name)}", sections[folder])]
    assert not unnamed, f"docs/architecture.md does not name these modules in their folder's section: {unnamed}"


def test_every_module_the_page_names_exists():
    stale = [f"{folder}{name}" for folder, text in _sections().items()
             for name in re.findall(r"(?<![\w/])(\w+\.py)\b", text) if not (ROOT / folder / name).is_file()]
    stale += [folder for folder in _sections() if not (ROOT / folder).is_dir()]
    assert not stale, f"docs/architecture.md names modules that are not there: {stale}"


def test_the_passes_are_named_in_the_registrys_order():
    text = PAGE.read_text()
    names = [p.name for p in PASSES]
    line = " ".join(m.group(0) for m in re.finditer(r"[^\n]*→[^\n]*", text))
    found = [w for w in re.findall(r"\b([a-z_][a-z0-9_]*)\b(?: \([^)]*\))?\s*(?:→|$)", line.replace("│", " "))
             if w in names]
    assert found == names, f"the page's pass line lists {found}; the registry runs {names}"
    rows = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    assert [r for r in rows if r in names] == names, f"the page's table of passes lists {rows}; the registry {names}"
