"""The two builds of the state: the pure-Python modules (the reference) and
the compiled ones tools/compile.py makes from them with the .pxd files beside
them. `make test` runs the in-process tests once against each."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from smallstalk.core import model
from smallstalk.core.state import BUILD

CORE = Path(__file__).resolve().parents[2] / "smallstalk" / "core"
CHAIN = ("queries.py", "moves.py", "state.py")  # the State chain, root first


def _declared(pxd: str) -> dict[str, set[str]]:
    """{class: the fields its `cdef public` lines declare} of a .pxd file."""
    out: dict[str, set[str]] = {}
    cls = None
    for line in (CORE / pxd).read_text().splitlines():
        if m := re.match(r"cdef class (\w+)", line):
            cls = m.group(1)
            out[cls] = set()
        elif m := re.match(r"\s+cdef public (?:object|long long|int|double) (.+)", line):
            out[cls] |= {name.strip() for name in m.group(1).split(",")}
    return out


def _assigned_on_self(path: Path) -> set[str]:
    """Every `self.NAME` a module's methods assign (plainly or augmented)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                        and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def test_the_build_under_test_is_the_one_asked_for() -> None:
    # `make test` sets SMALLSTALK_BUILD for its run against the compiled copy.
    want = os.environ.get("SMALLSTALK_BUILD", "pure Python")
    assert want == BUILD, (
        "the compiled modules are in the tree (`make compiled`): `make pure` removes them"
        if want == "pure Python" else "the compiled copy was not the one imported")


def test_the_pxd_files_declare_every_field_of_the_model() -> None:
    declared = _declared("model.pxd")
    for cls in (model.Job, model.Tube, model.Limit, model.Conn):
        assert declared[cls.__name__] == set(cls.__slots__), cls.__name__


def test_the_pxd_files_declare_every_field_the_state_chain_sets() -> None:
    # A field missing there would be an AttributeError in the compiled build only.
    declared = _declared("queries.pxd")["Queries"]
    assigned = set().union(*(_assigned_on_self(CORE / name) for name in CHAIN))
    assert assigned == declared
    for pxd in ("moves.pxd", "state.pxd"):  # the fields live on the chain's root
        assert not any(_declared(pxd).values()), pxd
