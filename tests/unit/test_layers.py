"""The package's layers, read from its imports (docs/ARCHITECTURE.md draws them).

Every module under smallstalk/ is parsed with `ast`; every import counts,
including those inside functions (they run later, but the module still
depends on what they import). `ALLOWED` below is the architecture's table of
arrows: for each layer (a folder of smallstalk/, or a top-level module), the
layers it may import. Every layer found in the package must have a row, the
table must have no cycle, and docs/ARCHITECTURE.md prints the same table.

Imports under `if TYPE_CHECKING:` count for the direction of the layers: a
type named in a signature is a dependency on the layer that defines it (the
code is written against that layer's API), whether or not the import runs. They
are exempt from the cycle rule and from core's ban on I/O modules, because
they never run: a lower layer may name an upper layer's type only if the table
allows the arrow anyway.

A failure lists each offending import as file:line.
"""

from __future__ import annotations

import ast
import re
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
# The architecture's arrows: layer -> the layers it may import (besides itself
# and the package root `smallstalk`, which holds only the version). The stack
# core -> storage -> server -> replication, ops, console -> cli, with config.py
# (flags and --config, parsed with server/'s policy and admin parsers) between
# server/ and the front ends; libraries beside it: client/ on core/, worker/ on
# client/, analytics/ on storage/. The operator's side may use them: ops/ and
# cli.py talk to a running server with client/'s token handling, console/ shows
# a job's worker task with worker/'s payload codec. usage.py is the command
# lines' one-line error helper, for front ends only.
ENGINE = {"core", "storage", "server"}
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "storage": {"core"},
    "server": {"core", "storage"},
    "config": ENGINE | {"usage"},
    "replication": ENGINE | {"config"},
    "ops": ENGINE | {"config", "client", "usage"},
    "console": ENGINE | {"config", "worker", "client", "ops"},
    "cli": ENGINE | {"config", "replication", "ops", "console", "client", "listen", "usage"},
    "listen": set(),  # binds the port before anything else is imported
    "launch": {"listen", "cli"},
    "__main__": {"launch"},
    "usage": set(),
    "client": {"core"},
    "worker": {"core", "client", "usage"},
    "analytics": {"core", "storage", "usage"},
}
ROOT = ""  # layer() of the package root, smallstalk/__init__.py


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
    assert {layer(m) for m in MODULES} >= set(ALLOWED)
    loop = [i for i in IMPORTS if i.module == "smallstalk.server.loop"]
    assert any(i.target == "smallstalk.core.state" for i in loop)
    assert any(i.target == "trio" for i in loop)
    assert any(i.type_checking for i in IMPORTS)
    assert any(not i.top_level for i in IMPORTS)


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


def test_every_layer_has_a_row() -> None:
    """A new folder or top-level module is placed in the table on purpose;
    a row whose folder or module is gone is taken out."""
    found = {layer(m) for m in MODULES} - {ROOT}
    assert sorted(found - set(ALLOWED)) == [], "layers without a row in ALLOWED"
    assert sorted(set(ALLOWED) - found) == [], "rows of ALLOWED without a layer"
    assert all(to <= set(ALLOWED) for to in ALLOWED.values())


def test_the_table_has_no_cycle() -> None:
    def imp(a: str, b: str) -> Import:
        return Import(a, PACKAGE / "x.py", 1, b, True, False)

    edges = {a: {b: imp(a, b) for b in to} for a, to in ALLOWED.items()}
    assert _cycles(edges) == []


def violations(imports: list[Import]) -> list[str]:
    """Each import that points where the table has no arrow, as file:line."""
    bad = []
    for i in imports:
        if not ours(i.target):
            continue
        low, to = layer(i.module), layer(i.target)
        if low == ROOT and to != ROOT:
            bad.append(f"{i.where()}: {i.module} imports {i.target} (the root imports nothing)")
        elif to not in (low, ROOT) and to not in ALLOWED.get(low, set()):
            why = " (under TYPE_CHECKING)" if i.type_checking else ""
            bad.append(f"{i.where()}: {i.module} imports {i.target}: {low} -> {to} is not "
                       f"an arrow of the table{why}")
    return bad


@pytest.mark.parametrize("low", sorted(ALLOWED))
def test_imports_follow_the_table(low: str) -> None:
    bad = violations([i for i in IMPORTS if layer(i.module) == low])
    may = ", ".join(sorted(ALLOWED[low])) or "nothing of ours"
    report(bad, f"{low} may import {may}")


def test_the_root_imports_nothing_of_ours() -> None:
    report(violations([i for i in IMPORTS if i.module == "smallstalk"]), "smallstalk/__init__.py")


def test_a_wrong_arrow_is_found() -> None:
    def imp(a: str, b: str, tc: bool = False) -> Import:
        return Import(a, PACKAGE / "x.py", 1, b, True, tc)

    bad = violations([imp("smallstalk.core.state", "smallstalk.server.loop"),
                      imp("smallstalk.server.dispatch", "smallstalk.replication.feed", tc=True),
                      imp("smallstalk.config", "smallstalk.cli"),
                      imp("smallstalk.client.core", "smallstalk.worker.codec"),
                      imp("smallstalk", "smallstalk.cli"),
                      imp("smallstalk.server.loop", "smallstalk.storage.journal"),
                      imp("smallstalk.cli", "smallstalk"),
                      imp("smallstalk.ops.ls", "os")])
    assert len(bad) == 5, bad
    assert "under TYPE_CHECKING" in bad[1]


def test_the_architecture_prints_the_table() -> None:
    """docs/ARCHITECTURE.md's table of arrows is this one."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    start = text.index("| layer | may import |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`([\w_]+)(?:/|\.py)?`", cells[1])
        for name in re.findall(r"`([\w_]+)(?:/|\.py)?`", cells[0]):
            rows[name] = set(names)
    assert rows == ALLOWED


@pytest.mark.parametrize("entry", ["smallstalk.launch", "smallstalk.config"])
def test_the_way_in_imports_no_trio(entry: str) -> None:
    """launch.py binds the port before trio is imported, and config.py parses
    the flags in time for it: what they import when loaded (transitively,
    within smallstalk/) imports no trio. Imports inside functions run later."""
    seen, todo, bad = {entry}, [entry], []
    while todo:
        module = todo.pop()
        for i in IMPORTS:
            if i.module != module or not i.top_level or i.type_checking:
                continue
            if i.target.split(".")[0] == "trio":
                bad.append(f"{i.where()}: {i.module} imports {i.target}")
            for t in (i.target, *_parents(i.target)):
                if t in MODULES and t not in seen:
                    seen.add(t)
                    todo.append(t)
    assert len(seen) > 1
    report(bad, f"importing {entry} imports trio")


def _parents(module: str) -> list[str]:
    """smallstalk.server.admin -> [smallstalk.server, smallstalk]: packages run first."""
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


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
