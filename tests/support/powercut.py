"""Power cuts for process tests: mount powercutfs.py, freeze processes, cut, kill.

`PowerCutMount.start(tmp)` runs the file system in its own process (see
powercutfs.py) and waits until it serves; `cut()` undoes everything not made
durable. `power_cut(mount, pids)` is the whole event for a running server:
every process writing there is frozen (SIGSTOP, and waited for until each of
its threads is stopped, so no request of theirs is in flight), the power is
cut, and they are SIGKILLed.

`fuse_problem()` says why FUSE cannot be used here (None if it can); the
`powercut_mount` fixture turns that into a skip for a developer who is not
root and a failure everywhere else: a test that cannot run must not pass.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs

from .procs import children

REPO = Path(__file__).resolve().parents[2]
INSTALL = ("apt-get install -y fuse3 libfuse3-dev pkg-config && pip install pyfuse3 "
           "(`make test` does both)")


def fuse_problem() -> str | None:
    """Why a FUSE file system cannot be mounted here, or None."""
    if os.geteuid() != 0:
        return "FUSE mounts need root here (run the power-cut tests as root)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (load the fuse module, or give the container /dev/fuse)"
    if shutil.which("fusermount3") is None:
        return f"fusermount3 is missing: {INSTALL}"
    try:
        import pyfuse3  # noqa: F401
    except ImportError as e:
        return f"pyfuse3 does not import ({e}): {INSTALL}"
    return None


class PowerCutError(RuntimeError):
    pass


@attrs.define
class PowerCutMount:
    """A running powercutfs: `path` is where to put the data directory."""

    path: Path
    backing: Path
    control: Path
    proc: subprocess.Popen
    log_path: Path
    cuts: list[dict[str, int]] = attrs.Factory(list)

    @classmethod
    def start(cls, tmp: Path, name: str = "disk", timeout: float = 30.0) -> PowerCutMount:
        path, backing = tmp / name, tmp / f"{name}.backing"
        control = tmp / f"{name}.control"
        path.mkdir()
        backing.mkdir()
        log_path = tmp / f"{name}.fs.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.powercutfs", str(backing), str(path),
                 str(control)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        m = cls(path, backing, control, proc, log_path)
        deadline = time.monotonic() + timeout
        while not (control.exists() and os.path.ismount(path)):
            if proc.poll() is not None or time.monotonic() > deadline:
                m.stop()
                raise PowerCutError(f"powercutfs did not mount {path}:\n{m.log()}")
            time.sleep(0.02)
        assert m.call("ping") == {}
        return m

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def call(self, cmd: str, timeout: float = 30.0) -> dict[str, int]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(self.control))
            s.sendall(cmd.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise PowerCutError(f"powercutfs closed the control socket:\n{self.log()}")
                buf += chunk
        words = buf.decode().split()
        if words[:1] != ["ok"]:
            raise PowerCutError(f"{cmd!r}: {buf.decode().strip()}")
        return {k: int(v) for k, v in (w.split("=") for w in words[1:])}

    def cut(self, torn_seed: int | None = None) -> dict[str, int]:
        """The power goes: everything not durable is undone. Returns what was."""
        got = self.call("cut" if torn_seed is None else f"cut torn {torn_seed}")
        self.cuts.append(got)
        return got

    def pending(self) -> dict[str, int]:
        return self.call("pending")

    def arm(self, dirname: str, drop: bool = False) -> None:
        """Cut right after the next fsync of directory `dirname` (with `drop`: one that
        makes a removal durable); then everything fails until `resume`."""
        self.call(f"arm {dirname}{' drop' if drop else ''}")

    def fired(self) -> bool:
        return bool(self.call("status")["dead"])

    def resume(self) -> None:
        self.call("resume")

    def stop(self) -> None:
        # Unconditionally: a dead file system fails the stat that os.path.ismount needs.
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False,
                       capture_output=True)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False,
                           capture_output=True)


# --- processes ------------------------------------------------------------------------




def _all_stopped(pid: int) -> bool:
    """Is every thread of `pid` stopped (or is it gone)?"""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                st = f.read()
        except OSError:
            continue
        if st[st.rfind(b")") + 2:].split()[0] not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def freeze(pid: int, timeout: float = 10.0) -> list[int]:
    """SIGSTOP `pid` and its children; return once every thread of them is stopped.

    A thread inside a request to the file system stops only when the request
    is answered, so after this nothing of theirs is in flight. Returns the
    pids frozen (the process first).
    """
    frozen = []
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGSTOP)
        frozen.append(p)
        deadline = time.monotonic() + timeout
        while not _all_stopped(p):
            if time.monotonic() > deadline:
                raise PowerCutError(f"process {p} did not stop within {timeout}s")
            time.sleep(0.002)
        todo += [c for c in children(p) if c not in frozen]  # stopped: it forks no more
    return frozen


def power_cut(mount: PowerCutMount | None, pid: int,
              torn_seed: int | None = None) -> dict[str, int]:
    """Freeze `pid` and its children, cut the power under them, SIGKILL them all.
    (`mount` None: an armed cut happened already; only freeze and kill.)"""
    frozen = freeze(pid)
    try:
        return mount.cut(torn_seed) if mount is not None else {}
    finally:
        for p in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def require_fuse() -> None:
    """Skip for a developer who is not root; fail anywhere else FUSE is missing (CI)."""
    import pytest

    problem = fuse_problem()
    if problem is None:
        return
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip(problem)
    pytest.fail(f"the power-cut tests cannot run: {problem}")


def mounted(tmp: Path, name: str = "disk"):
    """A fixture's body: a mounted powercutfs under `tmp`, unmounted afterwards."""
    require_fuse()
    m = PowerCutMount.start(tmp, name)
    try:
        yield m
    finally:
        m.stop()
