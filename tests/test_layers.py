"""Layer contracts: each part of fxshard imports only the layers below it, so a new upward import fails here.

From the bottom (DESIGN.md's data flow, with the driver and the command line on top)::

    leaves     errors, units, version, defaults, flags, graph, pyfile   import no other fxshard module
    runtime    what rank files import (torch alone)
    capture    torch.export of the model file
    ir         layout and mesh, placements, sharding rules, the collective table, node facts, the passes' context
    plan       styles, automatic pairing, experts
    passes     one pass per file, and the registry (passes/__init__.py): the only importer of a pass module
    codegen    rank files, manifest, weight shards
    compiler   capture -> passes -> code generation -> output folder
    check      static checks over a compiled program, verify's comparison  } two consumers of a compiled
    cost       the cost and time model, hardware profiles, the layout search  } program: neither imports the other
    train      fxshard run, checkpoints, export
    report     fxshard report
    driver     compile with its checks and auto policies, verify
    top        the package's public names, the command line, the test harness

Every import counts: at module level, inside a function, and under ``if TYPE_CHECKING:`` (a type-only import may
point up only where :data:`TYPE_ONLY_UP` says why).  Modules of one package may import each other, without cycles
but those :data:`KNOWN_CYCLES` names.  Importing the runtime loads no compiler module
(``tests/runtime/test_imports.py`` checks that by importing it).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"fxshard": ROOT / "fxshard", "fxshard.passes": ROOT / "passes", "fxshard.cli": ROOT / "cli"}
LEAVES = ("fxshard.errors", "fxshard.units", "fxshard.version", "fxshard.defaults", "fxshard.flags", "fxshard.graph",
          "fxshard.pyfile")
LAYERS = (
    LEAVES,
    ("fxshard.files",),  # safe writes, above the leaves (it raises FxshardError)
    ("fxshard.environment",),  # what fxshard runs with, for --version (it reads fxshard.version)
    ("fxshard.step_shape",),  # --seq and --batch, declared once (it reads fxshard.flags)
    ("fxshard.runtime",),
    ("fxshard.capture",),
    ("fxshard.ir",),
    ("fxshard.plan",),
    ("fxshard.passes",),
    ("fxshard.codegen",),
    ("fxshard.compiler",),
    ("fxshard.train.schedule",),  # the learning-rate schedule's arithmetic (leaves only): verify bounds AdamW by it
    ("fxshard.check", "fxshard.cost"),  # the two consumers of a compiled program, side by side
    ("fxshard.train",),
    ("fxshard.report",),
    ("fxshard.driver",),
    ("fxshard", "fxshard.cli", "fxshard.testing"),
)
# (importer, imported) -> why a type-only import points up
TYPE_ONLY_UP = {
    ("fxshard.ir.context", "fxshard.plan.styles"): "CompileContext carries the resolved plan; the plan reads ir",
}
KNOWN_CYCLES: dict = {}  # within one package, until the issue that removes them lands


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported fxshard module, line, type only) for every import statement of the module."""
    out = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, type_only)
            else:
                visit_stmt(child, type_only)

    def visit_stmt(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno, type_only) for a in node.names if a.name.split(".")[0] == "fxshard")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.split(".")[0] == "fxshard":
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out.append((full if full in modules else base, node.lineno, type_only))
        visit(node, type_only)

    visit(ast.parse(path.read_text()), False)
    return [(m, line, t) for m, line, t in out if m in modules and m != name]


def _layer(module: str) -> int | None:
    """The index of the most specific LAYERS entry holding ``module``."""
    best = None
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and entry != "fxshard" or module == entry:
                if best is None or len(entry) > best[1]:
                    best = (i, len(entry))
    return best[0] if best else None


@functools.cache
def _graph():
    modules = _modules()
    return modules, {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    modules, _ = _graph()
    unplaced = sorted(m for m in modules if _layer(m) is None)
    assert not unplaced, (f"modules in no layer of tests/test_layers.py's LAYERS (add them where they belong): "
                          f"{unplaced}")


def test_no_module_imports_a_layer_above_its_own():
    modules, graph = _graph()
    upward, type_only = [], set()
    for name, imports in graph.items():
        for imported, line, is_type in imports:
            if _layer(imported) > _layer(name):
                if is_type and (name, imported) in TYPE_ONLY_UP:
                    type_only.add((name, imported))
                    continue
                where = modules[name].relative_to(ROOT)
                upward.append(f"{where}:{line}: {name} imports {imported}{' (type only)' if is_type else ''}, a layer "
                              "above its own")
    assert not upward, "upward imports:\n  " + "\n  ".join(upward)
    assert type_only == set(TYPE_ONLY_UP), f"TYPE_ONLY_UP lists imports that are gone: {set(TYPE_ONLY_UP) - type_only}"


def test_leaves_import_no_fxshard_module():
    modules, graph = _graph()
    found = [f"{n} imports {m}" for n in modules if _layer(n) == 0 for m, _, _ in graph[n]]
    assert not found, found


def test_no_import_cycles_but_the_known_ones():
    _, graph = _graph()
    edges = {name: {m for m, _, _ in imports} for name, imports in graph.items()}
    cycles = {frozenset(c) for c in _strongly_connected(edges) if len(c) > 1}
    assert cycles <= set(KNOWN_CYCLES), f"import cycles: {[sorted(c) for c in cycles - set(KNOWN_CYCLES)]}"


def test_the_checks_and_the_cost_model_are_independent():
    """fxshard.check and fxshard.cost share a layer but neither imports the other: each reads the compiled program
    (and the layers below) on its own, so either can change without the other."""
    _, graph = _graph()

    def package(module: str) -> str | None:
        return next((p for p in ("fxshard.check", "fxshard.cost") if module == p or module.startswith(p + ".")), None)

    found = [f"{name} imports {m}" for name, imports in graph.items() for m, _, _ in imports
             if package(name) and package(m) and package(name) != package(m)]
    assert not found, found


# test files outside tests/passes/ that import a pass module, and why (a test of a pass may import that pass)
PASS_IMPORTS_IN_TESTS = {
    "tests/ir/single_op.py": "drives the tensor-parallel pass's own rewrites (apply_propagation) with a case's "
                             "placements: the sharding rules' property test",
}


def test_only_the_registry_imports_a_pass():
    """A pass is only a pass: the compiler reaches the passes through the registry (fxshard.passes.PASSES), and what a
    pass shares with other code lives in fxshard/ir or fxshard/graph.py.  So no module imports a pass module but the
    registry, and no test outside tests/passes/ but those PASS_IMPORTS_IN_TESTS names."""
    modules, graph = _graph()
    found = [f"{name} imports {m}" for name, imports in graph.items() for m, _, _ in imports
             if m.startswith("fxshard.passes.") and name != "fxshard.passes"]
    pattern = re.compile(r"^\s*(?:from\s+fxshard\.passes\.\w+\s+import|import\s+fxshard\.passes\.\w+)", re.M)
    for folder in ("tests", "benchmarks", "scripts", "zoo", "samples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where.startswith("tests/passes/") or where in PASS_IMPORTS_IN_TESTS:
                continue
            if pattern.search(path.read_text()):
                found.append(f"{where} imports a pass module")
    assert not found, "pass modules imported outside the registry:\n  " + "\n  ".join(found)
    assert all((ROOT / p).is_file() and pattern.search((ROOT / p).read_text()) for p in PASS_IMPORTS_IN_TESTS), \
        "PASS_IMPORTS_IN_TESTS names a file that imports no pass module"


def _strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of the import graph (iterative: no recursion limit)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.add(w)
                    if w == v:
                        break
                out.append(component)
    return out
