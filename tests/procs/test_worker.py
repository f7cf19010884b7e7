"""Tasks and the worker as processes (the lottery as pure functions is in tests/unit/):
publishing against a real server, and `python -m smallstalk worker` as a real
process against smallstalk and beanstalkd (killed mid-task, frozen past its
TTR, failing into bury, stopped with SIGTERM), plus the README example run as
written.

Tasks in tests/support/worker_app.py report by putting "<event>:<tag>" into the tube
"results", so every wait here is a bounded reserve or a bounded poll.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from smallstalk import worker as worker_module
from smallstalk.client import Client, NotFound, TimedOut
from smallstalk.worker import (
    App,
    decode_call,
    encode_call,
)
from smallstalk.worker import cli as worker_cli

from ..support.procs import (
    REPO,
    SERVER_KINDS,
    Server,
    free_port,
    needs_beanstalkd,
    start_beanstalkd,
    start_smallstalk,
)
from ..support.tlscerts import make_certs

# --- tasks and publishing ------------------------------------------------------


def test_task_names_from_a_script_match_the_module(tmp_path: Path) -> None:
    """`python tasks.py` names tasks "tasks.x", as the worker importing tasks does."""
    (tmp_path / "tasks.py").write_text(
        "from smallstalk.worker import App\napp = App('127.0.0.1:1')\n"
        "@app.task\ndef x(): pass\nprint(x.name)\n")
    out = subprocess.run([sys.executable, "tasks.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=30, env=env_with_repo())
    assert out.stdout.strip() == "tasks.x", out.stderr


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[Server]:
    srv = start_smallstalk(tmp_path_factory.mktemp("publish"))
    yield srv
    srv.stop()


def test_publish_puts_a_cbor_call_with_the_task_options(shared: Server) -> None:
    addr = f"127.0.0.1:{shared.port}"
    app = App(addr)

    @app.task(name="resize", tube="images", priority=7, ttr=45)
    def resize(path: str, width: int = 100) -> None:
        pass

    ref = resize.publish("a.png", width=200)
    later = resize.options(delay=300, priority=1).publish("b.png")
    with Client(addr) as c:
        job = c.peek(ref)
        assert decode_call(job.body) == ("resize", ["a.png"], {"width": 200})
        st = c.stats_job(ref)
        assert (st.tube, st.pri, st.ttr, st.state) == ("images", 7, 45, "ready")
        st = c.stats_job(later)
        assert (st.state, st.pri, st.delay) == ("delayed", 1, 300)

        async def from_trio() -> None:
            ref = await resize.apublish("c.png")
            assert decode_call(c.peek(ref).body)[1] == ["c.png"]

        trio.run(from_trio)
    app.close()


# --- the worker as a process -----------------------------------------------------


def env_with_repo(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@attrs.define
class WorkerProc:
    proc: subprocess.Popen
    stderr: Path
    stdout: Path

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stderr.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == event]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout=timeout)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., WorkerProc]]:
    started: list[WorkerProc] = []

    def start(addr: str, *args: str, app: str = "tests.support.worker_app:app",
              cwd: Path = REPO, cmd: list[str] | None = None) -> WorkerProc:
        n = len(started)
        err, out = tmp_path / f"worker{n}.err", tmp_path / f"worker{n}.out"
        cmd = cmd or [sys.executable, "-m", "smallstalk", "worker", app, *args]
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=open(out, "wb"), stderr=open(err, "wb"),
                                env=env_with_repo(SMALLSTALK_SERVERS=addr))
        started.append(WorkerProc(proc, err, out))
        return started[-1]

    yield start
    for w in started:
        if w.proc.poll() is None:
            os.kill(w.proc.pid, signal.SIGCONT)
            os.kill(w.proc.pid, signal.SIGKILL)
            w.proc.wait(timeout=10)


@pytest.fixture(params=SERVER_KINDS)
def server(request, tmp_path: Path) -> Iterator[Server]:
    """A fresh server per test: worker tests share tube names."""
    srv = start_smallstalk(tmp_path) if request.param == "smallstalk" else \
        start_beanstalkd(tmp_path)
    yield srv
    srv.kill()


@pytest.fixture
def smallstalk(tmp_path: Path) -> Iterator[Server]:
    srv = start_smallstalk(tmp_path)
    yield srv
    srv.kill()


def addr_of(srv: Server) -> str:
    return f"127.0.0.1:{srv.port}"


def publish(c: Client, task_name: str, *args: Any, tube: str = "default", ttr: int = 60,
            **kwargs: Any) -> Any:
    return c.put(encode_call(f"tests.support.worker_app.{task_name}", args, kwargs), ttr=ttr,
                 tube=tube)


def results(c: Client, count: int, timeout: float = 15.0, tube: str = "results") -> list[str]:
    """The next `count` reports, in order, waiting at most `timeout` in all."""
    deadline = time.monotonic() + timeout
    out = []
    while len(out) < count:
        left = deadline - time.monotonic()
        try:
            job = c.reserve(timeout=max(left, 0), tubes=[tube])
        except TimedOut:
            raise AssertionError(f"only {out} of {count} reports within {timeout}s") from None
        c.delete(job)
        out.append(job.body.decode())
    return out


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return result


def test_worker_runs_tasks_by_tube_and_logs_json(server: Server, workers) -> None:
    with Client(addr_of(server)) as c:
        refs = [publish(c, "echo", t) for t in "abc"]
        refs += [publish(c, "echo_high", "h", tube="high"), publish(c, "echo_low", "l",
                                                                     tube="low")]
        w = workers(addr_of(server), "--tubes", "high,default,low", "-c", "2")
        assert sorted(results(c, 5)) == ["done:a", "done:b", "done:c", "done:h", "done:l"]
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
        for ref in refs:
            with pytest.raises(NotFound):
                c.stats_job(ref)
    done = w.named("job.done")
    assert sorted((e["job"], e["tube"]) for e in done) == sorted(
        [(r.id, "default") for r in refs[:3]] + [(refs[3].id, "high"), (refs[4].id, "low")])
    assert all(e["server"] == addr_of(server) and e["ms"] >= 0 and e["level"] == "info"
               for e in done)
    start, = w.named("worker.start")
    assert start["tubes"] == {"high": 3.0, "default": 2.0, "low": 1.0}
    assert w.named("worker.stopped")[0]["done"] == 5


def test_killed_worker_job_comes_back_on_disconnect(server: Server, workers) -> None:
    with Client(addr_of(server)) as c:
        ref = publish(c, "hang", "k")
        w = workers(addr_of(server))
        assert results(c, 1) == ["started:k"]
        assert c.stats_job(ref).state == "reserved"
        w.signal(signal.SIGKILL)
        w.wait()
        job = c.reserve(timeout=5, tubes=["default"])  # back at once: the connection closed
        assert job.id == ref.id
        st = c.stats_job(job)
        assert (st.reserves, st.releases, st.timeouts) == (2, 0, 0)


def test_frozen_worker_job_comes_back_after_ttr(server: Server, workers) -> None:
    """SIGSTOP (the task stops its own process): the worker keeps its connection
    but does nothing; the TTR (4 s) runs out and the job is handed out again."""
    with Client(addr_of(server)) as c:
        ref = publish(c, "too_slow", "f", ttr=4)
        w = workers(addr_of(server))
        assert results(c, 1) == ["started:f"]
        started = time.monotonic()
        # Generous: a loaded 2-core machine once took more than 2 s past the TTR.
        job = c.reserve(timeout=15, tubes=["default"])
        assert job.id == ref.id and time.monotonic() - started < 12
        assert c.stats_job(job).timeouts == 1
        w.signal(signal.SIGKILL)
        w.signal(signal.SIGCONT)
        w.wait()


def test_retries_with_backoff_then_bury_with_the_error_recorded(server: Server,
                                                                 workers) -> None:
    with Client(addr_of(server)) as c:
        failing = publish(c, "always_fails", "r")
        garbage = c.put(b"not a task", tube="default")
        unknown = c.put(encode_call("tests.support.worker_app.nope", (), {}), tube="default")
        w = workers(addr_of(server))
        # retries=2: three attempts, one and then two seconds apart.
        assert results(c, 3, timeout=20) == ["attempt:r"] * 3
        records = [json.loads(r) for r in results(c, 3, timeout=10, tube="default.errors")]
        by_job = {r["job"]: r for r in records}
        assert set(by_job) == {failing.id, garbage.id, unknown.id}
        rec = by_job[failing.id]
        assert rec["error"] == "ValueError: boom r" and rec["attempts"] == 3
        assert rec["task"] == "tests.support.worker_app.always_fails" and rec["tube"] == "default"
        assert rec["server"] == addr_of(server) and "raise ValueError" in rec["traceback"]
        assert by_job[garbage.id]["error"].startswith("BadPayload")
        assert by_job[unknown.id]["error"].startswith("UnknownTask")
        st = c.stats_job(failing)
        assert (st.state, st.releases, st.buries, st.reserves) == ("buried", 2, 1, 3)
        for ref in (garbage, unknown):  # never retried
            st = c.stats_job(ref)
            assert (st.state, st.releases) == ("buried", 0)
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    retries = w.named("job.retry")
    assert [(e["attempt"], e["delay"]) for e in retries] == [(1, 1), (2, 2)]
    buried = {e["job"]: e for e in w.named("job.buried")}
    assert buried[failing.id]["error_tube"] == "default.errors"
    assert buried[failing.id]["level"] == "error" and "traceback" in buried[failing.id]


def test_sigterm_lets_the_running_job_finish(server: Server, workers) -> None:
    with Client(addr_of(server)) as c:
        ref = publish(c, "slow", "g", 1.0)
        w = workers(addr_of(server))
        assert results(c, 1) == ["started:g"]
        w.signal(signal.SIGTERM)
        assert results(c, 1) == ["done:g"]
        assert w.wait() == 0
        with pytest.raises(NotFound):
            c.stats_job(ref)
    events = [e["event"] for e in w.events()]
    assert events.index("worker.stopping") < events.index("job.done") < events.index(
        "worker.stopped")


def test_grace_expiry_hands_the_job_back_without_counting_a_failure(smallstalk: Server,
                                                                    workers) -> None:
    with Client(addr_of(smallstalk)) as c:
        ref = publish(c, "slow", "h", 60.0)
        w = workers(addr_of(smallstalk), "--grace", "0.3")
        assert results(c, 1) == ["started:h"]
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
        wait_until(lambda: c.stats_job(ref).state == "ready", what="the job back in ready")
        st = c.stats_job(ref)
        assert (st.releases, st.timeouts) == (0, 0)
    assert w.named("job.handed_back")[0]["job"] == ref.id


def test_second_signal_stops_at_once(smallstalk: Server, workers) -> None:
    with Client(addr_of(smallstalk)) as c:
        ref = publish(c, "slow", "i", 60.0)
        w = workers(addr_of(smallstalk), "--grace", "60")
        assert results(c, 1) == ["started:i"]
        w.signal(signal.SIGINT)
        wait_until(lambda: w.named("worker.stopping"), what="worker.stopping")
        w.signal(signal.SIGINT)
        assert w.wait(timeout=10) == 0
        wait_until(lambda: c.stats_job(ref).state == "ready", what="the job back in ready")


def test_concurrent_jobs_in_one_process(smallstalk: Server, workers) -> None:
    with Client(addr_of(smallstalk)) as c:
        for tag in "abc":
            publish(c, "gate", tag)
        w = workers(addr_of(smallstalk), "-c", "3")
        # All three run at once: each waits for its gate before finishing.
        assert sorted(results(c, 3)) == ["started:a", "started:b", "started:c"]
        for tag in "abc":
            c.put(b"go", tube=f"gate-{tag}")
        assert sorted(results(c, 3)) == ["done:a", "done:b", "done:c"]
        w.signal(signal.SIGTERM)
        assert w.wait() == 0


def test_touch_keeps_long_tasks_past_their_ttr(smallstalk: Server, workers) -> None:
    """ttr=2, running 2.5 s: without touches the async task would hit its time
    limit and the sync one would lose its job to the TTR."""
    with Client(addr_of(smallstalk)) as c:
        refs = [publish(c, "long_async", "a", 2.5, ttr=2),
                publish(c, "long_sync", "s", 2.5, ttr=2)]
        w = workers(addr_of(smallstalk), "-c", "2")
        assert sorted(results(c, 2)) == ["done:a", "done:s"]
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    assert sorted(e["job"] for e in w.named("job.done")) == sorted(r.id for r in refs)
    assert not w.named("job.lost") and not w.named("job.retry")


def test_the_time_limit_follows_the_job_s_own_ttr(smallstalk: Server, workers) -> None:
    """A task of ttr=60 published with options(ttr=3): the worker cancels it
    a second before the job's TTR, not the task's, so the server never hands
    it to another run meanwhile."""
    with Client(addr_of(smallstalk)) as c:
        body = encode_call("tests.support.worker_app.sleepy", ["t", 30.0], {}, ttr=3)
        ref = c.put(body, ttr=3)
        w = workers(addr_of(smallstalk), "-c", "2")
        assert results(c, 1) == ["started:t"]
        deadline = time.monotonic() + 30
        while c.stats_job(ref).state != "buried":  # retries=0: a failure buries it
            assert time.monotonic() < deadline, c.stats_job(ref)
            time.sleep(0.1)
        stats = c.stats_job(ref)
        assert (stats.reserves, stats.timeouts) == (1, 0)  # one run, no TTR ran out
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    (buried,) = w.named("job.buried")
    assert "no touch within 2s (ttr 3s)" in buried["error"]
    assert not w.named("job.lost") and not w.named("job.done")


@needs_beanstalkd
def test_worker_over_two_servers(smallstalk: Server, workers, tmp_path: Path) -> None:
    """Producers spread jobs over two servers that do not know each other; one
    worker process serves both, busy or idle."""
    other = start_beanstalkd(tmp_path)
    try:
        both = [addr_of(smallstalk), addr_of(other)]
        with Client(both) as c:
            refs = [publish(c, "echo", str(n)) for n in range(4)]
            assert {r.server for r in refs} == set(both)
            w = workers(",".join(both), "-c", "2")
            assert sorted(results(c, 4)) == [f"done:{n}" for n in range(4)]
            # Now idle (blocked on a reserve); new work on either server wakes it.
            for server in both:
                publish_to = Client(server)
                publish(publish_to, "echo", f"late-{server}")
                publish_to.close()
            assert sorted(results(c, 2)) == sorted(f"done:late-{s}" for s in both)
            w.signal(signal.SIGTERM)
            assert w.wait() == 0
        assert {e["server"] for e in w.named("job.done")} == set(both)
    finally:
        other.kill()


def test_worker_and_app_over_tls(workers, tmp_path: Path) -> None:
    """`App(ssl_context=)` publishes and `smallstalk worker --tls-ca` runs the job,
    both on the server's TLS port (their only address for it)."""
    certs = make_certs(tmp_path / "certs")
    tls_port = free_port()
    srv = start_smallstalk(tmp_path, *certs.server_flags(tls_port))
    try:
        tls_addr = f"127.0.0.1:{tls_port}"
        app = App(tls_addr, ssl_context=certs.client_context())
        app.client().put(encode_call("tests.support.worker_app.echo", ["tls"], {}))
        # The tasks report over plaintext ($SMALLSTALK_SERVERS); reserves go over TLS.
        w = workers(addr_of(srv), "--servers", tls_addr, "--tls-ca", str(certs.ca_file))
        with Client(addr_of(srv)) as c:
            assert results(c, 1) == ["done:tls"]
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
        app.close()
    finally:
        srv.kill()


def test_worker_sends_the_token_first(workers, tmp_path: Path, monkeypatch) -> None:
    """A worker authenticates before it reserves: with the server's token it runs
    jobs, with a wrong one every reserve is refused (UNAUTHORIZED, logged)."""
    token = tmp_path / "token"
    token.write_text("s3cr3t\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    srv = start_smallstalk(tmp_path, "--admin-token-file", str(token))
    try:
        w = workers(addr_of(srv), "--token-file", str(wrong))
        error = wait_until(lambda: w.named("reserve.error"), what="reserve.error")[0]["error"]
        assert "UNAUTHORIZED" in error, error
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
        with Client(addr_of(srv)) as c:
            c.use("default")
            c.put(encode_call("tests.support.worker_app.echo", ["authed"], {}))
        w = workers(addr_of(srv), "--token-file", str(token))
        with Client(addr_of(srv)) as c:
            assert results(c, 1) == ["done:authed"]
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    finally:
        srv.kill()
    app = App(addr_of(srv))
    monkeypatch.setenv("SMALLSTALK_TOKEN", "from-env")
    args = worker_cli._parser().parse_args(["x:app"])
    assert worker_cli._security(args, app).token == "from-env"
    monkeypatch.delenv("SMALLSTALK_TOKEN")
    assert worker_cli._security(args, app) is None  # the app's own settings


def test_bad_arguments(capsys, tmp_path: Path) -> None:
    for args in (["nosuchmodule:app"], ["tests.support.worker_app:RESULTS"], ["x:app", "--tubes", "a:0"],
                 ["tests.support.worker_app:app", "--tubes", "a:0"], ["tests.support.worker_app:app", "-c", "0"],
                 ["--no-such-flag"], ["tests.support.worker_app:app", "--tls-ca", str(tmp_path / "no")],
                 ["tests.support.worker_app:app", "--token-file", str(tmp_path / "no")],
                 ["tests.support.worker_app:app", "--tls-key", str(tmp_path / "no")],
                 ["tests.support.worker_app:app", "--batch", "0"],
                 ["tests.support.worker_app:app", "--batch", "1001"]):
        assert worker_module.main(args) == 2, args
    assert "smallstalk worker" in capsys.readouterr().err


# --- the README example, as written --------------------------------------------


def readme_blocks() -> dict[str, str]:
    """The example between `<!-- example -->` markers (README.md once merged
    there, else docs/CLIENT.md): ```python blocks whose first line is
    `# <file>`, and the ```console block of commands."""
    readme = REPO / "README.md"
    text = readme.read_text() if readme.exists() else ""
    if "<!-- example -->" not in text:
        text = (REPO / "docs" / "CLIENT.md").read_text()
    example = text[text.index("<!-- example -->"):text.index("<!-- /example -->")]
    blocks = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", example, re.S):
        if lang == "python":
            first, _, _ = body.partition("\n")
            blocks[first.removeprefix("# ").strip()] = body
        elif lang == "console":
            blocks["console"] = body
    return blocks


def test_readme_example_is_ten_lines_and_works_as_written(smallstalk: Server, workers,
                                                          tmp_path: Path) -> None:
    blocks = readme_blocks()
    code = [line for name in ("tasks.py", "produce.py") for line in blocks[name].splitlines()
            if line.strip() and not line.startswith("#")]
    assert len(code) <= 10, code
    for name in ("tasks.py", "produce.py"):
        (tmp_path / name).write_text(blocks[name])
    commands = [line[2:] for line in blocks["console"].splitlines() if line.startswith("$ ")]
    worker_cmd, producer_cmd = commands
    assert worker_cmd.startswith("smallstalk worker ") and producer_cmd == "python produce.py"
    bin_dir = Path(sys.executable).parent
    env = env_with_repo(SMALLSTALK_SERVERS=addr_of(smallstalk))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    producer = subprocess.run(producer_cmd.split(), cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=30)
    assert producer.returncode == 0, producer.stderr
    smallstalk_bin = bin_dir / "smallstalk"
    argv = worker_cmd.split()
    w = workers(addr_of(smallstalk), cwd=tmp_path,
                cmd=[str(smallstalk_bin) if smallstalk_bin.exists() else sys.executable,
                     *([] if smallstalk_bin.exists() else ["-m", "smallstalk"]), *argv[1:]])
    wait_until(lambda: "hello, world" in w.stdout.read_text(), timeout=15,
               what="the task's output")
    w.signal(signal.SIGTERM)
    assert w.wait() == 0
    assert w.named("job.done")


# --- batches (reserve-batch) ---------------------------------------------------------


def run_worker_until(worker: worker_module.Worker, done: Callable[[], bool],
                     timeout: float = 20.0, then: Callable[[], None] | None = None) -> None:
    """Run `worker` in trio until `done()`, then stop it (graceful) and wait for it."""

    async def main() -> None:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                while not done():
                    await trio.sleep(0.01)
                (then or worker.stop)()

    trio.run(main)


def test_batch_runs_jobs_in_reply_order_and_pipelines_the_deletes(smallstalk: Server) -> None:
    """Five quick async jobs in one reserve-batch: they run in the reply's
    order, and their five deletes go in one write (the flusher starts once
    the running job yields, and none of these does)."""
    addr = addr_of(smallstalk)
    app = App(addr)
    ran: list[int] = []

    @app.task(tube="batch")
    async def quick(n: int) -> None:
        ran.append(n)

    with Client(addr) as c:
        for n, pri in enumerate((5, 1, 5, 0, 9)):
            c.put(quick.encode([n], {}), priority=pri, tube="batch")
        w = worker_module.Worker(app, ["batch"], batch=8)
        run_worker_until(w, lambda: w.counts["done"] == 5)
        assert ran == [3, 1, 0, 2, 4]  # priority, then age: plain reserves' order
        assert w.counts == {"done": 5, "retried": 0, "buried": 0, "lost": 0,
                            "handed_back": 0, "delete_writes": 1}
        try:  # gone once the server saw the worker's connection close: no job either way
            ts = c.stats_tube("batch")
            assert (ts.current_jobs_ready, ts.current_jobs_reserved) == (0, 0)
        except NotFound:
            pass
        stats = c.stats()
        # No plain reserve: the jobs came in one reserve-batch.
        assert (stats.cmd_reserve, stats.cmd_reserve_with_timeout) == (0, 0)
        assert stats.cmd_delete == 5


def test_a_job_late_in_its_batch_is_touched_before_it_starts(smallstalk: Server) -> None:
    """ttr=4 (time limit 3 s): the second job of a batch waits 2 s behind the
    first, more than half its limit. Without a touch it would have 1 s left
    for its 1.5 s (the worker's time limit would fail it); touched first, it
    gets a whole TTR and a whole limit."""
    addr = addr_of(smallstalk)
    app = App(addr)

    @app.task(tube="late", ttr=60)
    async def first() -> None:
        await trio.sleep(2.0)

    @app.task(tube="late", ttr=4, retries=0)
    async def second() -> None:
        await trio.sleep(1.5)

    with Client(addr) as c:
        c.put(first.encode([], {}), tube="late", ttr=60)
        ref = c.put(second.encode([], {}), tube="late", ttr=4)
        w = worker_module.Worker(app, ["late"], batch=2)
        run_worker_until(w, lambda: w.counts["done"] + w.counts["buried"] == 2)
        assert w.counts["done"] == 2, w.counts
        with pytest.raises(NotFound):
            c.stats_job(ref)
        stats = c.stats()
        assert stats.cmd_touch == 1 and stats.job_timeouts == 0


def test_stopping_hands_back_the_jobs_of_a_batch_not_started(smallstalk: Server) -> None:
    """A stop while the first job of three runs: it finishes and is deleted;
    the two not started go back to ready at once, no failure counted."""
    addr = addr_of(smallstalk)
    app = App(addr)
    flags: dict[str, bool] = {}

    @app.task(tube="stop")
    async def work(n: int) -> None:
        flags[f"started{n}"] = True
        await trio.sleep(0.5)

    with Client(addr) as c:
        refs = [c.put(work.encode([n], {}), tube="stop") for n in range(3)]
        w = worker_module.Worker(app, ["stop"], batch=3)
        run_worker_until(w, lambda: flags.get("started0", False))
        assert w.counts["done"] == 1 and w.counts["handed_back"] == 2, w.counts
        assert list(flags) == ["started0"]
        with pytest.raises(NotFound):
            c.stats_job(refs[0])
        for ref in refs[1:]:
            st = c.stats_job(ref)
            assert (st.state, st.releases, st.timeouts, st.reserves) == ("ready", 0, 0, 1)


def test_worker_process_with_batch(smallstalk: Server, workers) -> None:
    with Client(addr_of(smallstalk)) as c:
        refs = [publish(c, "echo", t) for t in "abcd"]
        w = workers(addr_of(smallstalk), "--batch", "4")
        assert sorted(results(c, 4)) == ["done:a", "done:b", "done:c", "done:d"]
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
        for ref in refs:
            with pytest.raises(NotFound):
                c.stats_job(ref)
    assert w.named("worker.start")[0]["batch"] == 4
    stopped = w.named("worker.stopped")[0]
    assert stopped["done"] == 4 and stopped["delete_writes"] <= 4


@needs_beanstalkd
@pytest.mark.parametrize("slots", ["1", "4"])
def test_batch_against_beanstalkd_falls_back_to_plain_reserves(tmp_path: Path, workers,
                                                              slots: str) -> None:
    """beanstalkd answers reserve-batch BAD_FORMAT: one error line says so and
    the worker goes on one job at a time (with several slots, every slot's
    batch in flight meets it; the first says so, none fails)."""
    srv = start_beanstalkd(tmp_path)
    try:
        with Client(addr_of(srv)) as c:
            refs = [publish(c, "echo", t) for t in "abcdef"]
            w = workers(addr_of(srv), "--batch", "5", "-c", slots)
            assert sorted(results(c, 6)) == [f"done:{t}" for t in "abcdef"]
            w.signal(signal.SIGTERM)
            assert w.wait() == 0
            for ref in refs:
                with pytest.raises(NotFound):
                    c.stats_job(ref)
        (off,) = w.named("worker.batch_off")
        assert off["level"] == "error" and "drop --batch" in off["why"]
        assert not w.named("reserve.error")
    finally:
        srv.kill()
