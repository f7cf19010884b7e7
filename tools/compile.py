"""The optional compiled build: Cython over the pure modules named in
COMPILED, typed by the .pxd files beside them, and the C twins named in
TWINS, into a copy of the package.

The pure-Python modules stay the reference and what `pip install` gives: the
compiled build is an accelerator a user asks for (`make compiled`), and the
in-process tests run against both (`make test`). Usage:

    .venv/bin/python tools/compile.py [--out build/compiled] [--jobs 2]

then `PYTHONPATH=build/compiled smallstalk serve ...`, or `--inplace` to put
the extension modules beside the sources (Python then imports them first;
`make pure` removes them). `smallstalk --version` says which build runs.
Needs Cython (`pip install cython`) and a C compiler: without Cython it says
so in one line, and a failed compile shows the compiler's output; both exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The modules compiled. With a .pxd declaring their classes' fields: the State
# chain and what it is made of, the snapshot codec (a restart makes every job
# there), the two protocols' parsers, the records' encoder, the segment writer
# with the frame decoder, the journal with its histograms (a commit observes
# one each turn), and the loop's group (its session, commit, roles, the loop
# itself, dispatch, the connection, the poller and the timers' pass): classes
# whose fields only compiled code reads, as a compiled field read from
# interpreted code costs more than a slot. As they are: the rest of a
# restart's reading.
COMPILED = ["smallstalk/core/model.py", "smallstalk/core/readyheap.py",
            "smallstalk/core/commands.py",
            "smallstalk/core/keys.py",
            "smallstalk/core/queries.py",
            "smallstalk/core/moves.py", "smallstalk/core/state.py",
            "smallstalk/storage/snapshot_codec.py", "smallstalk/core/parser.py",
            "smallstalk/core/lines.py",
            "smallstalk/core/memcache.py", "smallstalk/storage/encoder.py",
            "smallstalk/storage/aof.py", "smallstalk/storage/journal.py",
            "smallstalk/storage/logread.py", "smallstalk/storage/observe.py",
            "smallstalk/storage/recovery.py", "smallstalk/storage/snapshot.py",
            "smallstalk/server/session.py", "smallstalk/server/commit.py",
            "smallstalk/server/roles.py", "smallstalk/server/loop.py",
            "smallstalk/server/dispatch.py", "smallstalk/server/connection.py",
            "smallstalk/server/poller.py", "smallstalk/server/timers.py"]
# Written for the compiled build alone, each the twin of code a pure module
# keeps as the reference and falls back to without it: the INSERTED and
# RESERVED replies (replies.py's formatting), a keyed put's key (parser.py's
# regex), a tube's ready heap
# (readyheap.py's list of ints), the everyday records' CBOR (cbor2 in
# encoder.py) and a frame's header (struct and zlib in aof.py), written in C.
TWINS = ["smallstalk/core/jobreply.pyx", "smallstalk/core/keyscan.pyx",
         "smallstalk/core/readyarray.pyx", "smallstalk/storage/fixedcbor.pyx",
         "smallstalk/storage/framehead.pyx"]


def _copy_package(out: Path) -> None:
    """A fresh copy of the package under `out`, without caches or old builds."""
    dest = out / "smallstalk"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ROOT / "smallstalk", dest,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))


@contextlib.contextmanager
def _output(quiet: bool):
    """With `quiet`, Cython's and the compiler's output only if the build fails."""
    if not quiet:
        yield
        return
    with tempfile.TemporaryFile("w+") as out:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        failed = True  # setup() says a failed compile with SystemExit
        try:
            yield
            failed = False
        finally:
            for fd, saved_fd in ((1, saved[0]), (2, saved[1])):
                os.dup2(saved_fd, fd)
                os.close(saved_fd)
            if failed:
                out.seek(0)
                sys.stderr.write(out.read())


def build(where: Path, jobs: int, quiet: bool = False) -> list[Path]:
    """Compile COMPILED in place under `where` (a directory holding smallstalk/);
    `quiet`: the compiler's output only if it fails."""
    try:
        from Cython.Build import cythonize
        from setuptools import Extension, setup
    except ImportError as e:
        raise SystemExit(f"tools/compile.py: {e.name} is missing; `pip install cython` "
                         "(the pure-Python build needs nothing)") from None
    os.chdir(where)
    sources = COMPILED + TWINS
    exts = [Extension(str(Path(m).with_suffix("")).replace("/", "."), [m]) for m in sources]
    args = ["-q", "build_ext", "--inplace", "-j", str(jobs),
            "--build-temp", str(where / "build-temp")]
    with _output(quiet):
        modules = cythonize(exts, language_level=3, quiet=True, nthreads=jobs)
        setup(name="smallstalk-compiled", ext_modules=modules, script_args=args)
    shutil.rmtree(where / "build-temp", ignore_errors=True)
    built = []
    for m in sources:
        found = sorted(Path(m).parent.glob(Path(m).stem + ".*.so"))
        if not found:
            raise SystemExit(f"tools/compile.py: no extension module for {m}")
        built.append(where / found[0])
        (where / m).with_suffix(".c").unlink(missing_ok=True)
    return built


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "compiled",
                    help="where the compiled copy of the package goes")
    ap.add_argument("--inplace", action="store_true",
                    help="compile beside the sources instead of into a copy")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quiet", action="store_true", help="no compiler output unless it fails")
    ap.add_argument("--quick", action="store_true",
                    help="the same C without the compiler's optimisations, built in a fifth "
                         "of the time: for tests (make test), not for speed")
    args = ap.parse_args(argv)
    if args.quick:  # after the interpreter's own flags (-O2 among them): this one wins
        os.environ["CFLAGS"] = os.environ.get("CFLAGS", "") + " -O0"
    if args.inplace:
        # Built in a copy all the same: setup() in the checkout would read the
        # project's own pyproject.toml, which the venv's setuptools may not.
        with tempfile.TemporaryDirectory(prefix="smallstalk-compile-") as tmp:
            _copy_package(Path(tmp))
            for so in build(Path(tmp), args.jobs, args.quiet):
                rel = so.relative_to(tmp)
                shutil.copy2(so, ROOT / rel)
                print(rel)
        print("the checkout runs the compiled build now (`make pure` to go back)")
        return
    where = args.out.resolve()
    where.mkdir(parents=True, exist_ok=True)
    _copy_package(where)
    for so in build(where, args.jobs, args.quiet):
        print(so.relative_to(where))
    print(f"run it with PYTHONPATH={where}")


if __name__ == "__main__":
    sys.exit(main())
