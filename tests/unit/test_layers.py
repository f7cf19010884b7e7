"""The package's layers, read from its imports (docs/ARCHITECTURE.md draws them).

Every module under smallstalk/ is parsed with `ast`; every import counts,
including those inside functions. Imports under `if TYPE_CHECKING:` never run,
so they are exempt from the cycle rule and from core's ban on I/O modules, but
not from the direction of the layers. A failure lists each offending import as
file:line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from ..support.procs import REPO

PACKAGE = REPO / "smallstalk"
MAX_LINES = 800
SIZE_NOTE = "# size:"  # in a module's first lines: why it may be longer
SIZE_NOTE_WITHIN = 10

# core/ is pure: no event loop, no clock, no files, no operating system.
IMPURE = {"trio", "time", "os", "socket", "select", "selectors", "threading", "pathlib", "io",
          "subprocess", "shutil", "tempfile", "signal", "fcntl", "mmap", "asyncio",
          "multiprocessing"}
TOP = {"cli", "launch", "config", "__main__"}
# layer -> the smallstalk layers it may not import (core is checked separately: only core)
FORBIDDEN = {
    "storage": {"server", "replication", "ops", "console"} | TOP,
    "server": {"replication", "ops", "console"} | TOP,
}


@attrs.frozen
class Import:
    module: str  # the importing module, e.g. smallstalk.server.loop
    path: Path
    line: int
    target: str  # absolute module name, e.g. smallstalk.core.protocol or os.path
    top_level: bool  # runs when the module is imported (not inside a function)
    type_checking: bool  # only under `if TYPE_CHECKING:`

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    """smallstalk.server.loop -> server; smallstalk.cli -> cli; smallstalk -> the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base.pop()
        base = base[:len(base) - (node.level - 1)]
        if node.module:
            base += node.module.split(".")
        pkg = ".".join(base)
    else:
        pkg = node.module or ""
    # `from pkg import name` imports the submodule pkg.name when there is one
    subs = [f"{pkg}.{a.name}" for a in node.names if f"{pkg}.{a.name}" in MODULES]
    return subs if len(subs) == len(node.names) else [pkg, *subs]


def imports_of(module: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), str(path))

    def walk(node: ast.AST, top: bool, tc: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield Import(module, path, child.lineno, a.name, top, tc)
            elif isinstance(child, ast.ImportFrom):
                for target in _resolve(module, path, child):
                    yield Import(module, path, child.lineno, target, top, tc)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module([stmt], []), top, True)
                for stmt in child.orelse:
                    yield from walk(ast.Module([stmt], []), top, tc)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False, tc)
            else:  # classes, try/except, with, plain if: still module level
                yield from walk(child, top, tc)

    yield from walk(tree, True, False)


IMPORTS = [imp for name, path in MODULES.items() for imp in imports_of(name, path)]


def ours(target: str) -> bool:
    return target == "smallstalk" or target.startswith("smallstalk.")


def report(bad: list[str], rule: str) -> None:
    if bad:
        pytest.fail(f"{rule}:\n  " + "\n  ".join(bad), pytrace=False)


def test_the_walk_sees_the_package() -> None:
    """The rules below check something: the layers and their imports are found."""
    assert {layer(m) for m in MODULES} >= {"core", "storage", "server", "replication", "ops"}
    loop = [i for i in IMPORTS if i.module == "smallstalk.server.loop"]
    assert any(i.target == "smallstalk.core.state" for i in loop)
    assert any(i.target == "trio" for i in loop)


def test_core_imports_only_core_and_nothing_impure() -> None:
    bad = []
    for i in IMPORTS:
        if layer(i.module) != "core":
            continue
        if ours(i.target) and layer(i.target) != "core":
            bad.append(f"{i.where()}: {i.module} imports {i.target} (outside core/)")
        elif i.target.split(".")[0] in IMPURE and not i.type_checking:
            bad.append(f"{i.where()}: {i.module} imports {i.target} (core/ is pure)")
    report(bad, "core/ imports only core/ and no trio, clock, files or os")


@pytest.mark.parametrize("low", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upward(low: str) -> None:
    bad = [f"{i.where()}: {i.module} imports {i.target}" for i in IMPORTS
           if layer(i.module) == low and ours(i.target)
           and layer(i.target) in FORBIDDEN[low]]
    report(bad, f"{low}/ may not import {', '.join(sorted(FORBIDDEN[low]))}")


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One cycle per strongly connected component (Tarjan), as a list of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, {}):
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # a shortest way from the first module back to itself
        members, start = set(comp), comp[0]
        paths = {w: [start, w] for w in edges[start] if w in members}
        frontier = list(paths)
        while start not in paths:
            nxt = []
            for v in frontier:
                for w in edges.get(v, {}):
                    if w in members and w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
            frontier = nxt
        cycles.append(paths[start])
    return cycles


@pytest.mark.parametrize("in_functions", [False, True], ids=["module-level", "with-lazy"])
def test_no_import_cycle(in_functions: bool) -> None:
    """Imports that run when a module is imported form no circle; and no circle
    hides behind an import inside a function either (type checking aside)."""
    edges: dict[str, dict[str, Import]] = {}
    for i in IMPORTS:
        if (i.top_level or in_functions) and not i.type_checking and i.target in MODULES:
            edges.setdefault(i.module, {}).setdefault(i.target, i)
    bad = []
    for cycle in _cycles(edges):
        steps = [f"{edges[a][b].where()}: {a} imports {b}" for a, b in zip(cycle, cycle[1:], strict=False)]
        bad.append(" -> ".join(m.rsplit(".", 1)[-1] for m in cycle) + "\n    "
                   + "\n    ".join(steps))
    report(bad, "import cycles" + (" (counting imports inside functions)" if in_functions else ""))


def test_cycle_finder_finds_a_cycle() -> None:
    def imp(a: str, b: str) -> Import:
        return Import(a, PACKAGE / "x.py", 1, b, True, False)

    edges = {"a": {"b": imp("a", "b")}, "b": {"c": imp("b", "c")}, "c": {"a": imp("c", "a")},
             "d": {"a": imp("d", "a")}}
    assert _cycles(edges) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b": imp("a", "b")}}) == []


def test_no_module_over_800_lines_without_a_reason() -> None:
    bad = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        head = lines[:SIZE_NOTE_WITHIN]
        if len(lines) > MAX_LINES and not any(ln.startswith(SIZE_NOTE) for ln in head):
            bad.append(f"{path.relative_to(REPO)}: {len(lines)} lines")
    report(bad, f"modules over {MAX_LINES} lines (or a `{SIZE_NOTE} why` line at the top)")
