"""The two builds of the state: the pure-Python modules (the reference) and
the compiled ones tools/compile.py makes from them with the .pxd files beside
them. `make test` runs the in-process tests once against each."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from smallstalk.core import model
from smallstalk.core.state import BUILD

PACKAGE = Path(__file__).resolve().parents[2] / "smallstalk"
CORE = PACKAGE / "core"
SERVER = PACKAGE / "server"
# Chains of classes whose fields all live on the root's declarations: the
# root's .pxd, then the modules of the chain, root first.
CHAINS = {CORE / "queries.pxd": ("queries.py", "moves.py", "state.py"),
          SERVER / "roles.pxd": ("roles.py", "loop.py")}
# Of those, the roots with a `__dict__` beside their fields (tests put their
# own methods on a loop); the state's has none: a stray field is an error.
WITH_DICT = {SERVER / "roles.pxd"}


def _declared(pxd: Path) -> dict[str, tuple[set[str], bool]]:
    """{class: (the fields its `cdef public` lines declare, has a __dict__)}."""
    out: dict[str, tuple[set[str], bool]] = {}
    cls = None
    for line in pxd.read_text().splitlines():
        if m := re.match(r"cdef class (\w+)", line):
            cls = m.group(1)
            out[cls] = (set(), False)
        elif re.match(r"\s+cdef dict __dict__", line):
            out[cls] = (out[cls][0], True)
        elif m := re.match(r"\s+cdef (?:public )?(?:long long|[\w.]+) (.+)", line):
            out[cls][0].update(name.strip() for name in m.group(1).split(","))
    return out


def _assigned_on_self(tree: ast.AST) -> set[str]:
    """Every `self.NAME` the methods under `tree` assign (plainly or augmented)."""
    names = set()
    for node in ast.walk(tree):
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


def _class_fields(module: Path, name: str) -> set[str]:
    tree = ast.parse(module.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return _assigned_on_self(cls)


def test_the_build_under_test_is_the_one_asked_for() -> None:
    # `make test` sets SMALLSTALK_BUILD for its run against the compiled copy.
    want = os.environ.get("SMALLSTALK_BUILD", "pure Python")
    assert want == BUILD, (
        "the compiled modules are in the tree (`make compiled`): `make pure` removes them"
        if want == "pure Python" else "the compiled copy was not the one imported")


def _tool():
    """tools/compile.py, as a module."""
    sys.path.insert(0, str(PACKAGE.parent / "tools"))
    try:
        import compile as tool
    finally:
        sys.path.pop(0)
    return tool


def test_without_cython_the_tool_says_what_to_install(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "Cython.Build", None)  # an import of it fails
    with pytest.raises(SystemExit) as e:
        _tool().build(tmp_path, 1)
    assert "`pip install cython`" in str(e.value) and "\n" not in str(e.value)


def test_every_module_with_declarations_is_compiled() -> None:
    tool = _tool()
    pxds = {p.relative_to(PACKAGE.parent).with_suffix(".py").as_posix()
            for p in PACKAGE.rglob("*.pxd") if not p.with_suffix(".pyx").is_file()}  # (a twin's)
    assert pxds <= set(tool.COMPILED)
    assert all((PACKAGE.parent / m).is_file() for m in tool.COMPILED)


def test_the_twins_are_built_with_the_compiled_modules_and_only_there() -> None:
    # A twin is C the compiled build runs in place of a pure module's code
    # (which stays the reference); the pure build must not find one in the
    # tree, and the compiled build must use every one it has.
    from smallstalk.core import model, readyheap
    from smallstalk.storage import aof, encoder

    tool = _tool()
    assert tool.TWINS == [p.relative_to(PACKAGE.parent).as_posix()
                          for p in sorted(PACKAGE.rglob("*.pyx"))]
    assert encoder.FIXED is aof.FAST_HEAD is (BUILD == "compiled")
    assert (readyheap.ReadyHeap is not readyheap.ListHeap) is (BUILD == "compiled")
    assert type(model.Tube("t").ready) is readyheap.ReadyHeap


def test_the_pxd_files_declare_every_field_their_classes_set() -> None:
    # A field missing there would be an AttributeError in the compiled build
    # only, and only where that line runs; one declared and never set, a slot
    # that every object carries for nothing.
    checked = 0
    for pxd in PACKAGE.rglob("*.pxd"):
        if pxd.with_suffix(".pyx").is_file():
            continue  # a twin's: C fields its own .pyx sets, which Cython checks
        for name, (declared, has_dict) in _declared(pxd).items():
            if any(pxd.parent == root.parent and pxd.name[:-4] + ".py" in chain
                   for root, chain in CHAINS.items()):
                continue  # the next test
            assigned = _class_fields(pxd.with_suffix(".py"), name)
            if has_dict:  # the rest may live in the __dict__
                assert declared <= assigned, (pxd.name, name, declared - assigned)
            else:
                assert declared == assigned, (pxd.name, name, declared ^ assigned)
            checked += 1
    # Job, Tube, Limit, Conn, Parser (two), LiveEncoder, SegmentWriter, Session,
    # GroupCommit, _Connection, Poller, the everyday commands and their base
    assert checked >= 18


def test_the_model_declares_its_slots() -> None:
    declared = _declared(CORE / "model.pxd")
    for cls in (model.Job, model.Tube, model.Limit, model.Conn):
        assert declared[cls.__name__][0] == set(cls.__slots__), cls.__name__


@pytest.mark.parametrize("root", CHAINS, ids=lambda root: root.name)
def test_the_pxd_files_declare_every_field_a_chain_sets(root: Path) -> None:
    # Every field the chain sets is declared, `__dict__` or not.
    [(declared, has_dict)] = _declared(root).values()
    assert has_dict == (root in WITH_DICT)
    chain = CHAINS[root]
    assigned = set().union(*(_assigned_on_self(ast.parse((root.parent / name).read_text()))
                             for name in chain))
    assert assigned == declared
    for module in chain[1:]:  # the fields live on the chain's root
        pxd = root.parent / (module[:-3] + ".pxd")
        assert not any(fields for fields, _ in _declared(pxd).values()), pxd.name


def test_a_job_is_never_in_a_reference_cycle() -> None:
    # The compiled build leaves jobs out of the cyclic collector (core/model.py's
    # Job): a job that something it refers to kept alive would never be freed
    # there. Jobs in every state, a keyed one, a paused tube: nothing reachable
    # from a job's fields is a job.
    import gc

    from smallstalk.core import records as r
    from smallstalk.core.state import State

    t0 = 1_700_000_000 * 10**9
    st = State()
    recs = [r.Put(1, t0, 1, 1, "a", 5, 0, 60, b"ready"),
            r.Put(2, t0, 1, 2, "a", 5, 30, 60, b"delayed"),
            r.Put(3, t0, 1, 3, "a", 5, 0, 60, b"to bury"),
            r.Put(4, t0, 1, 4, "a", 5, 0, 60, b"to reserve"),
            r.Watch(5, t0, 2, "a"), r.Reserve(6, t0, 2, 3), r.Bury(7, t0, 2, 3, 9),
            r.Reserve(8, t0, 2, 4), r.PauseTube(9, t0, 1, "a", 10),
            r.PutUnique(10, t0, 1, "b", "k", 60, 100, [(11, "b")], 5, 0, 60, 0, [], b"keyed")]
    for rec in recs:
        st.apply(rec)
    assert {j.state for j in st.jobs.values()} == {model.READY, model.DELAYED, model.BURIED,
                                                    model.RESERVED}
    for job in st.jobs.values():
        seen: set[int] = set()
        todo = [job.tube, job.body, job.counts]
        while todo:
            x = todo.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            assert not isinstance(x, model.Job), f"job {job.id} reaches job {x.id}"
            todo.extend(gc.get_referents(x))
        assert gc.is_tracked(job) is (BUILD != "compiled")
    # A keyed job's KeyHold (core/keys.py) likewise: two strs and an int.
    held = st.keys.of_job[11]
    assert (held.tube, held.key, st.keys.put_seq(11)) == ("b", "k", 10)
    assert gc.is_tracked(held) is (BUILD != "compiled")
