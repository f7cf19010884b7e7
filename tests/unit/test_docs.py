"""The docs name only what exists.

Every module path (`smallstalk.x.y`), repository file path (`docs/X.md`,
`smallstalk/...py`, `tests/...`, `bench/...`, `tools/...`, `contrib/...`,
`snapshots/...`, and `server/commit.py` below smallstalk/), bare file name
(`poller.py`), markdown link, `python -m` target and `file.py:function`
named in docs/*.md, snapshots/README.md, README.md and bench/README.md, and in
the comments and string literals (docstrings, usage texts) of the Python
under smallstalk/, bench/ and tools/, must exist: a module as its .py file or
package folder (a name after the module must be defined in it), a file or
folder on disk, a `python -m` target with a `__main__`, a function in its
file. A renamed or moved module fails here with each place that still names
it, as `file:line: name`.

What is deliberately not checked is listed in the allowances below, each
with its reason: URLs, paths of a data directory or of the host, names with a
placeholder in them, and the few file names an example creates.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..support.procs import REPO

PACKAGE = REPO / "smallstalk"

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "snapshots" / "README.md",
                                                REPO / "README.md", REPO / "bench" / "README.md"]
CODE = sorted([*PACKAGE.rglob("*.py"), *(REPO / "bench").glob("*.py"),
               *(REPO / "tools").glob("*.py")])
# Where bare file names (`poller.py`) may live: the folders of the repository
# that hold code and docs (not .venv, data directories or build output).
ROOTS = ["smallstalk", "tests", "bench", "tools", "contrib", "snapshots", "docs"]

NOT_AFTER = r"(?<![\w./$~-])"  # a name starts here, not inside a longer path or a URL
MODULE = re.compile(NOT_AFTER + r"smallstalk(?:\.\w+)+")
REPO_PATH = re.compile(NOT_AFTER + r"(?:smallstalk|docs|tests|bench|tools|contrib|snapshots)/"
                       r"[\w./<>*{}-]*")
# `server/commit.py`, `procs/test_crash.py`: a path below smallstalk/ or tests/
SHORT_PATH = re.compile(NOT_AFTER + r"(?:core|storage|server|replication|ops|console|client|"
                        r"worker|analytics|unit|inproc|procs|support)/[\w/]+\.py\b")
BARE_FILE = re.compile(NOT_AFTER + r"[\w-]+\.py\b(?![/\w])")
PYTHON_M = re.compile(r"\bpython3?\s+-m\s+([\w.]+)")
FUNCTION = re.compile(NOT_AFTER + r"((?:[\w-]+/)*[\w-]+\.py):([A-Za-z_][\w.]*)")
STRING_PREFIX = re.compile(r"[A-Za-z]*")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
# (docs/CLIENT.md, "TLS and the admin token"), (README, Replication): a section by name
SECTION = re.compile(NOT_AFTER + r"((?:docs/|snapshots/|bench/)?(?:[A-Z][A-Z-]*\.md|README))"
                     r", (\"[^\"]+\"|[A-Z][\w' -]*?)(?=[).;,]|$)", re.M)

# --- allowances (each is not a name of this repository) ----------------------------------
# Names with a placeholder or a wildcard are patterns: `snapshots/<seq>.snap`
# is a file of a data directory (which has a snapshots/ folder too).
PLACEHOLDER = re.compile(r"[<>*{}]")
# Modules of other projects that the docs run with `python -m`.
OTHER_MODULES = {"venv", "build", "pip", "pytest"}
# File names that are not modules: the systemd units (contrib/systemd/ has
# them), the zip of the package that the Spark pipeline ships to its workers.
NOT_MODULES = {"smallstalk.service", "smallstalk.socket", "smallstalk.zip"}
# Not paths: a ratio (smallstalk's figure over beanstalkd's, bench/run.py's tables).
NOT_PATHS = {"smallstalk/beanstalkd"}
# Bare file names an example asks the reader to create.
EXAMPLE_FILES = {"produce.py"}
# Logger names are a namespace of their own (`smallstalk.console.http`): the
# string literal a `getLogger(` call starts with is not read.
LOGGER_CALL = "getLogger"


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def code_texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and string literal (docstrings, usage
    texts) of a Python file, but for logger names."""
    before: list[str] = ["", ""]  # the two tokens before this one
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and before != [LOGGER_CALL, "("]:
            prefix = STRING_PREFIX.match(tok.string).group(0).lower()
            if "b" not in prefix:  # bytes are data, not names
                # an f-string as written: its {fields} are placeholders
                yield tok.start[0], tok.string if "f" in prefix else ast.literal_eval(tok.string)
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            before = [before[1], tok.string]


def texts(kind: str) -> Iterator[tuple[Path, int, str]]:
    """(file, first line, text) of every place this test reads: the docs, or the code."""
    if kind == "docs":
        for path in DOCS:
            yield path, 1, path.read_text()
    else:
        for path in CODE:
            for line, text in code_texts(path):
                yield path, line, text


# --- what exists ------------------------------------------------------------------------


@functools.cache
def _defined(path: Path) -> frozenset[str]:
    """Names a module defines at its top (functions, classes, assignments,
    imports) and, as Class.name, in its classes."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        targets: list[ast.AST] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(f"{node.name}.{item.name}")
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for t in item.targets if isinstance(item, ast.Assign) else [item.target]:
                            if isinstance(t, ast.Name):
                                names.add(f"{node.name}.{t.id}")
        elif isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    names.add(n.id)
    return frozenset(names)


def module_file(name: str) -> Path | None:
    """The file of module `name` (a package's __init__.py), or None."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_problem(name: str) -> str | None:
    """None if `name` is a module, or a module and a name defined in it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        # `smallstalk.worker.App`, `smallstalk.worker.context.touch`: defined there
        if rest[0] in _defined(path) or ".".join(rest[:2]) in _defined(path):
            return None
        return f"no module {'.'.join(parts[:cut + 1])} (and {path.relative_to(REPO)} " \
               f"defines no {rest[0]})"
    return "no such module"


def python_m_problem(name: str) -> str | None:
    if name.split(".")[0] not in ROOTS:
        return None if name in OTHER_MODULES else "not a module of ours nor a known tool"
    base = REPO.joinpath(*name.split("."))
    if (base / "__main__.py").is_file():
        return None
    if base.with_suffix(".py").is_file():
        if '__name__ == "__main__"' in base.with_suffix(".py").read_text():
            return None
        return "the module runs nothing as a program"
    return "no such module"


@functools.cache
def basenames() -> frozenset[str]:
    names = {p.name for root in ROOTS for p in (REPO / root).rglob("*") if p.is_file()}
    return frozenset(names | {p.name for p in REPO.iterdir() if p.is_file()})


@functools.cache
def anchors(doc: Path) -> frozenset[str]:
    """The anchors GitHub makes of a markdown file's headings."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
    return frozenset(re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads)


def section_problem(doc: str, section: str, where: Path) -> str | None:
    """None if `doc` has a heading, or a bold lead (`- **Restart**`), that
    starts with `section`."""
    name = doc if doc.endswith(".md") else doc + ".md"
    for base in (where.parent, REPO, REPO / "docs"):
        if (base / name).is_file():
            text = (base / name).read_text()
            break
    else:
        return "no such document"
    heads = re.findall(r"^#+ (.+)$|\*\*([^*]+)\*\*", text, re.M)
    if any((h or b).lower().startswith(section.lower()) for h, b in heads):
        return None
    return "no heading of that name there"


def _strip(path: str) -> str:
    return path.rstrip(".,;:)'\"`")


def function_problem(file: str, name: str, where: Path) -> str | None:
    for base in (REPO, PACKAGE, REPO / "tests", where.parent):
        path = base / file
        if path.is_file():
            break
    else:
        return f"no file {file}"
    name = name.rstrip(".")
    if name in _defined(path) or name.split(".")[0] in _defined(path) and "." not in name:
        return None
    return f"{file} defines no {name}"


# --- the checks -------------------------------------------------------------------------


def problems_in(text: str, where: Path, first_line: int = 1) -> list[str]:
    """Each name in `text` that does not exist, as `file:line: name (why)`."""
    bad: list[str] = []

    def fail(pos: int, name: str, why: str) -> None:
        bad.append(f"{where.relative_to(REPO)}:{first_line + _line(text, pos) - 1}: "
                   f"{name} ({why})")

    for m in MODULE.finditer(text):
        name = m.group(0)
        if name in NOT_MODULES:
            continue
        why = module_problem(name)
        if why:
            fail(m.start(), name, why)
    for m in PYTHON_M.finditer(text):
        why = python_m_problem(m.group(1))
        if why:
            fail(m.start(), m.group(0), why)
    for m in REPO_PATH.finditer(text):
        path = _strip(m.group(0))
        if PLACEHOLDER.search(path) or path in NOT_PATHS:
            continue
        if not (REPO / path).exists():
            fail(m.start(), path, "no such file or folder")
    for m in SHORT_PATH.finditer(text):
        path = m.group(0)
        if not any((base / path).is_file() for base in (PACKAGE, REPO / "tests")):
            fail(m.start(), path, "no such file below smallstalk/ or tests/")
    for m in BARE_FILE.finditer(text):
        name = m.group(0)
        if name not in basenames() and name not in EXAMPLE_FILES:
            fail(m.start(), name, "no file of that name in the repository")
    for m in FUNCTION.finditer(text):
        why = function_problem(m.group(1), m.group(2), where)
        if why:
            fail(m.start(), m.group(0), why)
    for m in SECTION.finditer(text):
        why = section_problem(m.group(1), " ".join(m.group(2).strip('"').split()), where)
        if why:
            fail(m.start(), m.group(0), why)
    if where.suffix == ".md":
        for m in MD_LINK.finditer(text):
            target, _, anchor = m.group(1).partition("#")
            if re.match(r"[a-z]+:", target):  # a URL, mailto:
                continue
            doc = where.parent / target if target else where
            if not doc.exists():
                fail(m.start(), target, "the link's target does not exist")
            elif anchor and doc.suffix == ".md" and anchor not in anchors(doc):
                fail(m.start(), m.group(1), "no such heading there")
    return bad


def test_the_checker_catches_stale_names(tmp_path: Path) -> None:
    """The checker finds what a rename leaves behind (these sentences are
    from docs/ARCHITECTURE.md before the package was split into folders)."""
    stale = """
    calls the connection's `on_readable` (`server.py`), which reads
    The replica's `Follower` (`replica.py`) hands each received batch
      `python -m smallstalk.compactor DATA_DIR SEGMENT...` over a fixed list of
    see [the format](../snapshots/FORMAT.md), `smallstalk/server/server.py`,
    `server/replica.py`, `smallstalk.server.loop.NoSuchThing`, `tests/test_protocol.py`,
    `server/loop.py:MutationLoop.no_such_method`, [gone](PERFORMANCE.md#no-such-section)
    (docs/CLIENT.md, "TLS and tokens"), (README, Replicas).
    """
    bad = problems_in(stale, REPO / "docs" / "ARCHITECTURE.md")
    for name in ("server.py", "replica.py", "python -m smallstalk.compactor",
                 "smallstalk.compactor", "../snapshots/FORMAT.md", "smallstalk/server/server.py",
                 "server/replica.py", "smallstalk.server.loop.NoSuchThing",
                 "tests/test_protocol.py", "server/loop.py:MutationLoop.no_such_method",
                 "PERFORMANCE.md#no-such-section", 'docs/CLIENT.md, "TLS and tokens"',
                 "README, Replicas"):
        assert any(f": {name} (" in b for b in bad), (name, bad)
    fine = """
    `smallstalk.storage.compactor` (`python -m smallstalk.storage.compactor`),
    `server/poller.py`, `poller.py`, `smallstalk/server/loop.py:MutationLoop.turn`,
    https://example.com/smallstalk/x.py, /var/lib/smallstalk/snapshots/1.snap,
    `DATA_DIR/aof/<first seq>.aof`, `snapshots/<seq>.snap`, `smallstalk.worker.App`,
    contrib/systemd/smallstalk.service, [security](SECURITY.md),
    [the table](PERFORMANCE.md#the-current-table), [spine](#the-layers),
    (docs/CLIENT.md, "TLS and the admin token"), (README, Replication), (PERFORMANCE.md, Restart)
    """
    assert problems_in(fine, REPO / "docs" / "ARCHITECTURE.md") == []


@pytest.mark.parametrize("kind", ["docs", "code"])
def test_every_name_exists(kind: str) -> None:
    bad = [b for path, line, text in texts(kind) for b in problems_in(text, path, line)]
    if bad:
        pytest.fail("names of things that do not exist:\n  " + "\n  ".join(bad), pytrace=False)


def _folder_table() -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's table of folders: folder -> the modules it lists."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    start = text.index("| folder | modules | holds |")
    listed: dict[str, set[str]] = {}
    for row in text[start:].splitlines()[2:]:
        if not row.startswith("|"):
            break
        what, modules = (c.strip() for c in row.strip("|").split("|")[:2])
        if what == "libraries":  # `client/` (`errors`, ...), `worker/` (...)
            for folder, names in re.findall(r"`(\w+)/` \(([^)]*)\)", modules):
                listed[folder] = set(re.findall(r"`(\w+)`", names))
        else:
            folder = what.strip("`/") if what.startswith("`") else ""  # "top level"
            listed[folder] = set(re.findall(r"`(\w+)`", modules))
    return listed


def test_the_architecture_lists_every_module() -> None:
    """The folder table names each module of each folder, and no other."""
    listed = _folder_table()
    bad = []
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")}):
        name = "" if folder == PACKAGE else folder.name
        have = {p.stem for p in folder.glob("*.py")} - {"__init__"}
        if name:
            have.discard("__main__")  # `python -m smallstalk.analytics`: the command's way in
        if listed.get(name) != have:
            bad.append(f"{name or 'top level'}: missing {sorted(have - listed.get(name, set()))}, "
                       f"gone {sorted(listed.get(name, set()) - have)}")
    assert not bad, "docs/ARCHITECTURE.md's folder table:\n  " + "\n  ".join(bad)
