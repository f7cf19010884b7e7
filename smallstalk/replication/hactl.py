"""`smallstalk ha`: the operator's verbs for an HA cluster (status, switchover, pause, resume).

They talk to the store only (etcd's JSON gateway), never to the members: the
members read the same keys on their next cycle (replication/cluster.py says
which). `status` lists members, roles, epochs, seqs and lag, as
`patronictl list` does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import trio

HELP = """\
usage: smallstalk ha COMMAND [--etcd URL[,URL...]] [--cluster NAME] [--config FILE]

Commands:
  status                 members, roles, epochs, durable seqs, lag; the last failovers
  switchover [--to NODE] the primary stops taking writes, NODE (default: the most
                         advanced replica) catches up and takes the lock; nothing
                         acknowledged is lost. Waits until it is done (--wait SEC, default 60)
  pause                  no automatic failover until `resume` (maintenance)
  resume                 automatic failover again

--etcd and --cluster are the servers' --ha-etcd and --ha-cluster; --config FILE
reads them from the servers' configuration file (its [ha] table).
"""


class HAUsage(Exception):
    pass


def _options(argv: list[str]) -> tuple[str, dict[str, str]]:
    if not argv or argv[0] in ("-h", "--help", "help"):
        raise SystemExit(print(HELP) or 0)
    command, rest = argv[0], argv[1:]
    if command not in ("status", "switchover", "pause", "resume"):
        raise HAUsage(f"unknown command {command!r}")
    opts: dict[str, str] = {}
    while rest:
        flag = rest.pop(0)
        name, eq, value = flag.partition("=")
        if name not in ("--etcd", "--cluster", "--config", "--to", "--wait"):
            raise HAUsage(f"unknown option {flag}")
        if not eq:
            if not rest:
                raise HAUsage(f"{name} needs a value")
            value = rest.pop(0)
        opts[name[2:]] = value
    if "to" in opts and command != "switchover":
        raise HAUsage("--to is for switchover")
    return command, opts


def _store_settings(opts: dict[str, str]) -> tuple[list[str], str]:
    urls: tuple[str, ...] = ()
    cluster = "smallstalk"
    if "config" in opts:
        from smallstalk.config import ha_settings
        from smallstalk.server.policy import ConfigError, read_toml

        path = Path(opts["config"]).absolute()
        try:
            settings = ha_settings(read_toml(path), path)
        except ConfigError as e:
            raise HAUsage(str(e)) from None
        urls = settings.get("ha.etcd", urls)
        cluster = settings.get("ha.cluster", cluster)
    if "etcd" in opts:
        urls = tuple(u.strip() for u in opts["etcd"].split(",") if u.strip())
    cluster = opts.get("cluster", cluster)
    if not urls:
        raise HAUsage("where is the store? --etcd URL (or --config FILE with an [ha] table)")
    return list(urls), cluster


def main(argv: list[str]) -> int:
    try:
        command, opts = _options(argv)
        urls, cluster = _store_settings(opts)
        try:
            wait = float(opts.get("wait", "60"))
        except ValueError:
            raise HAUsage(f"--wait takes seconds, got {opts['wait']!r}") from None
    except HAUsage as e:
        print(f"smallstalk ha: {e} (see `smallstalk ha -h`)", file=sys.stderr)
        return 2
    from smallstalk.replication.etcd import Etcd, StoreUnavailable

    async def run() -> int:
        store = Etcd(urls, timeout=3.0)
        try:
            return await COMMANDS[command](store, cluster, opts, wait)
        finally:
            await store.aclose()

    try:
        return trio.run(run)
    except StoreUnavailable as e:
        print(f"smallstalk ha: the store does not answer: {e}", file=sys.stderr)
        return 1


async def _view(store, cluster: str):
    from smallstalk.replication import cluster as cl

    rev, kvs = await store.get_prefix(cl.prefix(cluster))
    return cl.read_cluster(cluster, rev, kvs)


def render_status(c) -> str:
    """The `status` table (a Cluster from the store)."""
    lead = c.leader
    lines = [f"leader: {lead.name} (epoch {lead.epoch})" if lead else
             "leader: none (the lock is free)"]
    if c.paused:
        lines.append("PAUSED: no automatic failover (smallstalk ha resume)")
    if c.switchover:
        lines.append(f"switchover asked: {json.dumps(c.switchover)}")
    rows = [("MEMBER", "ROLE", "EPOCH", "SEQ", "LAG", "ADDRESS", "HTTP")]
    for m in sorted(c.members.values(), key=lambda m: m.name):
        role = m.role + (" (leader)" if lead and lead.name == m.name else "")
        rows.append((m.name, role, str(m.epoch), str(m.seq), str(m.lag), m.advertise,
                     m.http or "-"))
    for name in sorted(c.known - set(c.members)):
        rows.append((name, "down (no report)", "-", "-", "-", "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    if c.failovers:
        lines.append("last failovers:")
        for f in list(c.failovers)[-5:]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.get("time", 0)))
            lines.append(f"  epoch {f.get('epoch')}: {f.get('name')} "
                         f"(from {f.get('from') or '-'}, seq {f.get('seq')}) at {when}")
    return "\n".join(lines)


async def status(store, cluster: str, opts: dict, wait: float) -> int:
    c = await _view(store, cluster)
    if not c.members and not c.known:
        print(f"smallstalk ha: no member of cluster {cluster!r} in the store", file=sys.stderr)
        return 1
    print(f"cluster {cluster}")
    print(render_status(c))
    return 0


async def pause(store, cluster: str, opts: dict, wait: float) -> int:
    from smallstalk.replication import cluster as cl

    await store.put(cl.prefix(cluster) + "pause", b"1")
    print("paused: no automatic failover until `smallstalk ha resume`")
    return 0


async def resume(store, cluster: str, opts: dict, wait: float) -> int:
    from smallstalk.replication import cluster as cl

    await store.delete(cl.prefix(cluster) + "pause")
    print("resumed: automatic failover is on")
    return 0


async def switchover(store, cluster: str, opts: dict, wait: float) -> int:
    from smallstalk.replication import cluster as cl

    c = await _view(store, cluster)
    if c.leader is None:
        print("smallstalk ha: no leader holds the lock: nothing to switch over",
              file=sys.stderr)
        return 1
    target = opts.get("to")
    if target is not None:
        m = c.members.get(target)
        if m is None or target == c.leader.name:
            print(f"smallstalk ha: {target} is not a replica of this cluster "
                  f"(members: {', '.join(sorted(c.members))})", file=sys.stderr)
            return 1
    old = c.leader.name
    await store.put(cl.prefix(cluster) + "switchover",
                    json.dumps({"from": old, "to": target}).encode())
    deadline = trio.current_time() + wait
    while trio.current_time() < deadline:
        await trio.sleep(0.2)
        c = await _view(store, cluster)
        lead = c.leader
        if lead is not None and lead.name != old and c.members.get(lead.name) is not None \
                and c.members[lead.name].role == "primary":
            print(f"switched over: {old} -> {lead.name} (epoch {lead.epoch})")
            return 0
    print(f"smallstalk ha: no switchover within {wait:.0f}s (the target did not catch up?); "
          "see `smallstalk ha status` and the servers' logs", file=sys.stderr)
    return 1


COMMANDS = {"status": status, "switchover": switchover, "pause": pause, "resume": resume}
