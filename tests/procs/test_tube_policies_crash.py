"""Crash rounds with tube policies: a real server configured by its TOML file,
producers putting into an expiring tube (dead-letter `exp.dead`), a fanout
parent with two fanout tubes, and a small discard-old-when-full tube, all under
a tiny read-behind budget; the server (and its compactor) SIGKILLed mid-load.

After every restart, every acknowledged put is there with its exact body:
its fanout copies beside it, expired jobs moved (never lost), the limited
tube holding the newest jobs and counting the rest as discarded. At the end
the data directory rebuilds, in-process, a state whose invariants hold.

SMALLSTALK_TUBE_POLICIES_CRASH_ROUNDS sets the number of rounds (default 3); the test prints
its random seed, and SMALLSTALK_CRASH_SEED=N replays a run.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from smallstalk.storage import recovery

from ..support.bsclient import Client, connect, peek_ids, put_cmd, stats_jobs
from ..support.procs import Server, start_smallstalk, wait_for
from ..support.threads import start as start_thread
from .test_crash import crash, wait_gone

ROUNDS = int(os.environ.get("SMALLSTALK_TUBE_POLICIES_CRASH_ROUNDS", "3"))
LIMIT = 40
CONFIG = f"""
[tubes.exp]
max-age = 2
expire-to = "exp.dead"

[tubes.lim]
max-jobs = {LIMIT}
discard-old-when-full = true
"""


def put(c: Client, tube: bytes, body: bytes) -> int | None:
    c.send(b"use %s\r\n" % tube + put_cmd(body))
    c.read()
    reply = c.read()
    return reply.id if reply.status == b"INSERTED" else None


def produce(port: int, rng: random.Random, acked: dict, stop: threading.Event) -> None:
    """Put until the server dies (or 2,000 puts); record what was acknowledged."""
    try:
        with connect(port) as c:
            for n in range(2000):
                if stop.is_set():
                    return
                tube = rng.choice([b"exp", b"fan", b"lim"])
                body = b"%s-%d-%s" % (tube, n, rng.randbytes(rng.randrange(4, 600)).hex().encode())
                jid = put(c, tube, body)
                if jid is not None:
                    acked[tube][jid] = body
    except (OSError, ValueError):
        return  # the kill: what was acknowledged is recorded


def start(tmp: Path, data: Path, cfg: Path) -> Server:
    return start_smallstalk(tmp, "--config", str(cfg), "--fsync", "always", "--max-memory", "16KB",
                            "--segment-records", "300", "--compact-interval", "0.3",
                            data_dir=data)


def check(port: int, acked: dict) -> None:
    with connect(port) as c:
        # Fanout: every acknowledged put into `fan` and its copies (ids id+1, id+2).
        fan = acked[b"fan"]
        want = {}
        for jid, body in fan.items():
            want.update({jid: body, jid + 1: body, jid + 2: body})
        got = peek_ids(c, sorted(want))
        missing = sorted(set(want) - set(got))
        assert not missing, f"fanout jobs lost: {missing[:10]}"
        assert all(got[j] == want[j] for j in want), "a fanout body changed"
        tubes = stats_jobs(c, sorted(want))
        for jid in fan:
            assert [tubes[j]["tube"] for j in (jid, jid + 1, jid + 2)] == [
                "fan", "fan+a", "fan+b"]
        # Expiry: never lost, only moved (to exp.dead, with the same body).
        exp = acked[b"exp"]
        got = peek_ids(c, sorted(exp))
        assert set(got) == set(exp), f"expiring jobs lost: {sorted(set(exp) - set(got))[:10]}"
        assert all(got[j] == exp[j] for j in exp)
        where = stats_jobs(c, sorted(exp))
        assert {where[j]["tube"] for j in exp} <= {"exp", "exp.dead"}
        # The limited tube keeps the newest jobs; the others were discarded and counted.
        lim = acked[b"lim"]
        st = {**c.call(b"stats-tube lim\r\n").yaml(),
              **c.call(b"ext-stats-tube lim\r\n").yaml()} if lim else None
        if st is not None:
            present = peek_ids(c, sorted(lim))
            assert int(st["current-jobs-ready"]) <= LIMIT
            assert all(present[j] == lim[j] for j in present)
            if present:
                newest = [j for j in lim if j > min(present)]
                assert set(newest) <= set(present), "a newer job was dropped before an older one"
            assert len(lim) - len(present) <= int(st["jobs-discarded"])


def test_crash_rounds_with_expiry_fanout_limits_and_read_behind(tmp_path: Path,
                                                                servers: list[Server]) -> None:
    seed = int(os.environ.get("SMALLSTALK_CRASH_SEED") or random.randrange(2**32))
    print(f"SMALLSTALK_CRASH_SEED={seed}")  # shown with a failure: rerun with it to replay
    rng = random.Random(seed)
    data = tmp_path / "data"
    cfg = tmp_path / "smallstalk.toml"
    cfg.write_text(CONFIG)
    acked: dict[bytes, dict[int, bytes]] = {b"exp": {}, b"fan": {}, b"lim": {}}
    srv = start(tmp_path, data, cfg)
    servers.append(srv)
    with connect(srv.port) as c:  # register the fanout tubes (logged: they survive)
        c.call(b"watch fan+a\r\n")
        c.call(b"watch fan+b\r\n")
    for _ in range(ROUNDS):
        stop = threading.Event()
        producers = [start_thread(produce, srv.port, random.Random(rng.random()), acked, stop)
                     for _ in range(2)]
        time.sleep(rng.uniform(0.5, 1.5))  # let load build; the kill lands wherever it lands
        orphans = crash(srv, with_children=rng.random() < 0.5)
        stop.set()
        for t in producers:
            t.join(timeout=30)
        wait_gone(orphans, 30)
        srv = start(tmp_path, data, cfg)
        servers.append(srv)
        check(srv.port, acked)
        with connect(srv.port) as c:  # recovery kept the backlog's bodies on disk
            assert int(c.ext_stats()["bytes-on-disk"]) > 0
    assert all(acked.values()), {k: len(v) for k, v in acked.items()}
    print(f"{ROUNDS} rounds, acknowledged puts: {({k.decode(): len(v) for k, v in acked.items()})}")
    # Eventually every expiring job is in the dead-letter tube (2 s max-age).
    with connect(srv.port) as c:
        def all_dead() -> bool:
            where = stats_jobs(c, sorted(acked[b"exp"]))
            return all(where[j]["tube"] == "exp.dead" for j in acked[b"exp"])

        wait_for(all_dead, timeout=30, what="expired jobs moved to exp.dead")
        dead = c.call(b"stats-tube exp.dead\r\n").yaml()
        assert int(dead["current-jobs-ready"]) >= len(acked[b"exp"])
        if len(acked[b"lim"]) > LIMIT:
            assert int(c.call(b"ext-stats-tube lim\r\n").yaml()["jobs-discarded"]) > 0
    check(srv.port, acked)
    srv.kill()
    rebuilt = recovery.recover(data, repair=False).state
    rebuilt.check()
    assert set(acked[b"exp"]) <= set(rebuilt.jobs)
    assert {rebuilt.jobs[j].tube.name for j in acked[b"exp"]} == {"exp.dead"}
