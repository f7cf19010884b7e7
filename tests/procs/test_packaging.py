"""The package as a user gets it: `python -m build` makes an sdist and a wheel, the wheel
installs into a fresh virtual environment (no system site-packages), and its `smallstalk`
script serves a put and a reserve. Without the analytics extra, `smallstalk analyze`
says which extra to install instead of failing with a traceback.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.support.procs import REPO, free_port, wait_for_log

pytestmark = pytest.mark.slow

# What the sdist is made from; tests and benchmarks stay out.
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "smallstalk", "contrib",
           "docs"]


def clean_env() -> dict[str, str]:
    """No PYTHONPATH: the installed package, not this checkout, must be the one imported."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist and wheel, built from a copy of the sources (the build writes egg-info)."""
    top = tmp_path_factory.mktemp("build")
    src = top / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(REPO / name, src / name)
    out = top / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def venv(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300,
                   env=clean_env())
    assert "include-system-site-packages = false" in (where / "pyvenv.cfg").read_text()
    wheel = next(built.glob("smallstalk-*.whl"))
    proc = subprocess.run([str(where / "bin" / "pip"), "install", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    return where


def test_sdist_and_wheel_hold_the_package(built: Path) -> None:
    (sdist,) = built.glob("smallstalk-*.tar.gz")
    (wheel,) = built.glob("smallstalk-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # Every file of the package (data files too, such as templates) is in the wheel.
    for path in (REPO / "smallstalk").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            assert path.relative_to(REPO).as_posix() in names
    meta = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in meta
    assert "Classifier: Programming Language :: Python :: 3" in meta
    assert re.search(r"^Project-URL: Source, https://", meta, re.M)
    assert "Description-Content-Type: text/markdown" in meta
    assert any(n.endswith("licenses/LICENSE") for n in names)
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    top = members[0].split("/")[0]
    for name in ("LICENSE", "README.md", "contrib/systemd/smallstalk.service",
                 "smallstalk/cli.py"):
        assert f"{top}/{name}" in members


def test_the_installed_script_serves(venv: Path, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(venv / "bin" / "smallstalk"), "serve", "-p", str(port),
                                 "-b", str(tmp_path / "data")],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=clean_env())
    try:
        wait_for_log(log_path, f"listening on 127.0.0.1:{port}", proc)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"put 0 0 60 5\r\nhello\r\nreserve-with-timeout 0\r\n")
            want = b"INSERTED 1\r\nRESERVED 1 5\r\nhello\r\n"
            got = b""
            while len(got) < len(want):
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
            assert got == want
    finally:
        proc.kill()
        proc.wait()
    # The server that ran was the installed one.
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import smallstalk; print(smallstalk.__file__)"],
                           capture_output=True, text=True, env=clean_env(), cwd=tmp_path)
    assert where.stdout.startswith(str(venv))


def test_analyze_without_the_extra_says_what_to_install(venv: Path, tmp_path: Path) -> None:
    (tmp_path / "data" / "aof").mkdir(parents=True)
    proc = subprocess.run([str(venv / "bin" / "smallstalk"), "analyze", "--out",
                           str(tmp_path / "out"), str(tmp_path / "data")],
                          capture_output=True, text=True, env=clean_env(), cwd=tmp_path,
                          timeout=120)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "install smallstalk[analytics]" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
