"""The servers a benchmark starts, and what it reads of them: smallstalk, beanstalkd, the floors.

A `Server` is one process started on 127.0.0.1 and a free port, stopped by
its PID; CPU time and RSS come from the kernel (`proc_cpu_ns`, /proc). The
floor (bench/floor.py) is a stateless server with smallstalk's I/O shape:
what smallstalk's own work per command is measured against; the writing floor
is the same server appending a record per put to a log it never fsyncs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SERVERS = ("smallstalk", "beanstalkd")
FLOOR = "floor"
FLOOR_LOG = "floor-log"  # the writing floor: bench/floor.py --log
FLOORS = (FLOOR, FLOOR_LOG)
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Durability modes, side by side: (smallstalk flags, beanstalkd flags, needs a data dir)
MODES = {
    "memory": ([], [], False),
    "never": (["--fsync", "never"], ["-F"], True),
    "always": (["--fsync", "always"], ["-f", "0"], True),
}


def compile_package(src: Path | None = None) -> None:
    """Write the bytecode of the smallstalk package the servers run (`src` or the
    working tree's), as `pip install` does: a server spawned with
    PYTHONDONTWRITEBYTECODE set (or from a fresh copy) would otherwise compile
    every module from source at each start, ~75 ms of a ~140 ms spawn."""
    import compileall

    compileall.compile_dir(str((src or REPO) / "smallstalk"), quiet=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_ticks(pid: int) -> int:
    return sum(proc_user_sys_ticks(pid))


def proc_user_sys_ticks(pid: int) -> tuple[int, int]:
    """(utime, stime) of the whole thread group, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def proc_cpu_ns(pid: int) -> int | None:
    """utime+stime of the whole thread group in ns: the kernel's CPU clock of another process
    (clock_getcpuclockid), the same sum /proc/PID/stat reports in 10 ms ticks."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except OSError:
        return None


def proc_run_wait_s(pid: int) -> float | None:
    """Seconds the process's threads have waited on a run queue (runnable, not running:
    the CPU was someone else's), summed from /proc/PID/task/*/schedstat. With the
    CPU time it splits a wall time into running, waiting for a CPU, and blocked."""
    try:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        return None


def python_facts() -> dict:
    """What the interpreter's speed depends on, for comparing machines: the CPU
    architecture, how CPython was configured (pyenv's default build has neither
    PGO nor LTO and is a shared libpython; a distribution's may do PGO without
    saying so in CONFIG_ARGS), and whether cbor2 is compiled."""
    import platform
    import sysconfig

    config = sysconfig.get_config_var("CONFIG_ARGS") or ""
    facts = {"machine": platform.machine(),
             "enable_optimizations": "--enable-optimizations" in config,
             "lto": "--with-lto" in config,
             "shared": bool(sysconfig.get_config_var("Py_ENABLE_SHARED"))}
    try:
        import cbor2

        facts["cbor2"] = getattr(cbor2, "__version__", None) or _dist_version("cbor2")
        facts["cbor2_compiled"] = type(cbor2.loads).__name__ == "builtin_function_or_method"
    except ImportError:
        facts["cbor2"] = None
    return facts


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def proc_status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def fsync_probe(directory: Path, count: int = 10, limit: float = 0.5) -> float | None:
    """4 KiB appends + fsync per second on the disk under `directory`, right now.

    Other tenants' I/O moves this a lot; it puts the fsync-bound rows in context."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        block = b"\0" * 4096
        t0 = time.monotonic()
        done = 0
        while done < count and time.monotonic() - t0 < limit:
            os.write(fd, block)
            os.fsync(fd)
            done += 1
        return round(done / (time.monotonic() - t0), 1)
    except OSError:
        return None
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class Server:
    """One server process we started; stop() signals only its PID."""

    def __init__(self, kind: str, mode: str, workdir: Path, data_dir: Path | None = None,
                 smallstalk_python: str = sys.executable, src: Path | None = None):
        self.kind = kind
        self.mode = mode
        self.port = free_port()
        self.data_dir = data_dir
        if (MODES[mode][2] or kind == FLOOR_LOG) and data_dir is None and kind != FLOOR:
            self.data_dir = Path(tempfile.mkdtemp(prefix=f"{kind}-{mode}-", dir=workdir))
        ss_flags, bs_flags, persistent = MODES[mode]
        if kind in FLOORS:  # no durability mode: the plain floor keeps nothing
            cmd = [sys.executable, str(HERE / "floor.py"), "-l", "127.0.0.1", "-p",
                   str(self.port)]
            if kind == FLOOR_LOG:
                cmd += ["--log", str(self.data_dir / "records.log")]
        elif kind == "smallstalk":
            cmd = [smallstalk_python, "-m", "smallstalk", "serve", "-l", "127.0.0.1",
                   "-p", str(self.port)]
            if persistent:
                cmd += ["--data-dir", str(self.data_dir), *ss_flags]
        else:
            cmd = [beanstalkd_path(), "-l", "127.0.0.1", "-p", str(self.port)]
            if persistent:
                cmd += ["-b", str(self.data_dir), *bs_flags]
        self.cmd = cmd
        # src: a directory holding a copy of the smallstalk package to run instead of the
        # working tree (PYTHONPATH beats the editable install; cwd must not be the repo).
        self.cwd = REPO if src is None or kind != "smallstalk" else src
        self.env = None
        if src is not None and kind == "smallstalk":
            self.env = dict(os.environ)
            self.env["PYTHONPATH"] = os.pathsep.join(
                [str(src)] + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else []))
        self.log_path = workdir / f"{kind}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.t_spawn = 0.0

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.t_spawn = time.monotonic()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, env=self.env,
                                         stdin=subprocess.DEVNULL)

    def wait_port(self, timeout: float = 60.0) -> float:
        """Seconds from spawn until a TCP connect succeeds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return time.monotonic() - self.t_spawn
            except OSError:
                time.sleep(0.005)
        raise RuntimeError(f"{self.kind} did not listen within {timeout}s")

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds from spawn until a `stats` is answered: a server may accept
        connections (listen backlog) well before it serves them."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                stats(self.port, timeout=max(0.1, deadline - time.monotonic()))
                return time.monotonic() - self.t_spawn
            except (OSError, RuntimeError):
                if not self.alive():
                    raise RuntimeError(f"{self.kind} exited: {self.log_tail()}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def start(self) -> Server:
        self.spawn()
        self.wait_port()
        self.wait_ready()
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_ticks(self) -> int:
        return proc_cpu_ticks(self.pid)

    def rss_kb(self) -> int:
        return proc_status_kb(self.pid, "VmRSS")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log_tail(self, n: int = 800) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def beanstalkd_path() -> str:
    path = shutil.which("beanstalkd") or ("/usr/bin/beanstalkd"
                                          if os.path.exists("/usr/bin/beanstalkd") else None)
    if path is None:
        raise SystemExit("beanstalkd is not installed (apt-get install beanstalkd)")
    return path


def stats(port: int, timeout: float = 10.0) -> dict[str, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        return stats_on(s)


def stats_on(s: socket.socket) -> dict[str, str]:
    s.sendall(b"stats\r\n")
    head, rest = read_line(s, b"")
    if not head.startswith(b"OK "):
        raise RuntimeError(f"stats answered {head!r}")
    need = int(head.split()[1]) + 2
    rest = recv_until(s, rest, need)
    out = {}
    for line in rest[: need - 2].decode().splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def current_jobs(st: dict[str, str]) -> int:
    return sum(int(st.get(f"current-jobs-{k}", 0))
               for k in ("ready", "reserved", "delayed", "buried"))


def recv_until(s: socket.socket, buf: bytes, need: int) -> bytes:
    while len(buf) < need:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError("connection closed")
        buf += chunk
    return buf


def read_line(s: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    while b"\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError("connection closed")
        buf += chunk
    line, _, rest = buf.partition(b"\r\n")
    return line, rest



def git_info(src: Path | None = None) -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    digest = hashlib.sha256()
    for p in sorted(((src or REPO) / "smallstalk").rglob("*.py")):
        digest.update(p.name.encode() + b"\0" + p.read_bytes())
    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "smallstalk")),
            "smallstalk_src_sha256": digest.hexdigest()[:16]}


def smallstalk_build(src: Path | None = None) -> str:
    """Which build of smallstalk's state the servers run (`src` or the working
    tree's): "pure Python", or "compiled" after `make compiled`."""
    env = dict(os.environ, PYTHONPATH=str(src or REPO))
    out = subprocess.run([sys.executable, "-c",
                          "from smallstalk.core.state import BUILD; print(BUILD)"],
                         env=env, cwd="/", capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or "unknown"


def beanstalkd_version() -> str:
    try:
        return subprocess.run([beanstalkd_path(), "-v"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"

