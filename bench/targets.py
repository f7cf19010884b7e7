"""The performance goals, and how one run's results are judged against them.

Two kinds of goal: ratios smallstalk / beanstalkd measured in one run
(`TARGETS`, RSS, restart, hand-off, spawn), and smallstalk's server CPU per
command relative to the floor's CPU per put in the same run (`FLOOR_TARGETS`):
the broker's own cost, which does not depend on the machine the way ops/s do.
"""

from __future__ import annotations

import statistics


def _targets() -> tuple:
    """The goals as ratios smallstalk / beanstalkd in one run:
    (description, mode, workload, conns, metric, goal, comparison)."""
    t = []
    ops = "ops_per_sec"
    for mode in ("memory", "never"):  # request/response (ops/s: judge on a quiet machine)
        for wl in ("put", "rd", "cycle"):
            for conns, goal in ((1, 0.6), (10, 0.5), (100, 0.85)):
                t.append((f"req/resp at {conns} conn{'s' * (conns > 1)}", mode, wl, conns, ops,
                          goal, ">="))
    for mode in ("memory", "never", "always"):  # pipelined, 100 per send
        for wl, conns in (("put-pipe", 1), ("put-pipe", 10), ("rd-pipe", 10)):
            t.append(("pipelined, 100 per send", mode, wl, conns, ops, 1.2, ">="))
        # beanstalkd cannot batch: its column is reserve+delete, 100 per send
        # (measure.BEANSTALKD_BASELINE); the goal is the pipelined one's.
        t.append(("reserve-batch 100 + deletes vs bs reserve+delete 100/send", mode,
                  "rd-batch", 10, ops, 1.2, ">="))
    for wl, conns, goal in (("put", 10, 2.0), ("rd", 10, 1.0), ("cycle", 10, 1.5),
                            ("put", 50, 2.0), ("put", 100, 2.0), ("put", 200, 2.0),
                            ("rd", 100, 1.0), ("cycle", 50, 1.5), ("cycle", 100, 1.5),
                            ("cycle", 200, 1.5)):  # group commit against one fsync per write
        t.append(("fsync every ack", "always", wl, conns, ops, goal, ">="))
    return tuple(t)


TARGETS = _targets()
# smallstalk's server CPU per command over the floor's per put, same run (see
# `vs_floor`): (mode, workload, conns, goal at most). The main goal: it does
# not depend on the machine as ops/s ratios do.
FLOOR_TARGETS = tuple((mode, wl, conns, goal) for mode in ("memory", "never")
                      for wl in ("put", "rd", "cycle")
                      for conns, goal in ((10, 1.6), (100, 1.4)))
RSS_GOAL = 1.3  # RSS per job, at most this ratio
KEYED_PUT_GOAL = 1.1  # server CPU per keyed put / per plain put, same mode and conns
RESTART_GOAL = 1.0  # restart with a million jobs: no slower
HANDOFF_GOAL = 1.5  # hand-off p50 and p99, at most this ratio
SPAWN_BEYOND_TRIO_MS = 40.0  # spawn to first reply, at most this beyond `import trio`


def vs_floor(row_servers: dict, commands_per_op: int | dict, floor: dict | None) -> dict:
    """Server CPU per command of each server over the floor's CPU per put
    (`commands_per_op`: one for the row, or each server's, by kind)."""
    base = (floor or {}).get("server_cpu_us_per_op")
    out = {}
    for kind in ("smallstalk", "beanstalkd"):
        us = row_servers.get(kind, {}).get("server_cpu_us_per_op")
        cpo = commands_per_op.get(kind, 1) if isinstance(commands_per_op, dict) \
            else commands_per_op
        out[kind] = None if us is None or not base else round(us / cpo / base, 3)
    return out


def _met(ratio, goal: float, cmp: str) -> bool | None:
    if ratio is None:
        return None
    return bool(ratio >= goal if cmp == ">=" else ratio <= goal)


def evaluate_targets(rows: list[dict], rss: dict, startup: dict, handoff: dict | None = None,
                     spawn: dict | None = None, open_loop: list | None = None) -> list[dict]:
    """Each goal of TARGETS and FLOOR_TARGETS (and RSS, restart, hand-off,
    spawn) against this run; points the run did not measure are left out."""
    found = {(r["mode"], r["workload"], r["conns"]): r for r in rows}
    open_found = {(r["mode"], r["workload"], r["conns"]): r for r in open_loop or ()}
    out = []
    for desc, mode, wl, conns, metric, goal, cmp in TARGETS:
        row = found.get((mode, wl, conns))
        if row is None:
            continue
        ratio = row["ratio"].get(metric)
        out.append({"target": desc, "point": f"{mode}/{wl}/{conns}", "metric": metric,
                    "smallstalk": _get(row, "smallstalk", metric),
                    "beanstalkd": _get(row, "beanstalkd", metric),
                    "ratio": ratio, "goal": f"{cmp} {goal}", "met": _met(ratio, goal, cmp)})
    for label, found_rows in (("saturated", found), ("open loop", open_found)):
        for mode, wl, conns, goal in FLOOR_TARGETS:
            row = found_rows.get((mode, wl, conns))
            if row is None or "vs_floor" not in row:
                continue
            ratio = row["vs_floor"].get("smallstalk")
            out.append({"target": f"CPU/command vs floor, {label}",
                        "point": f"{mode}/{wl}/{conns}", "metric": "vs_floor",
                        "smallstalk": row["vs_floor"].get("smallstalk"),
                        "beanstalkd": row["vs_floor"].get("beanstalkd"),
                        "ratio": ratio, "goal": f"<= {goal}", "met": _met(ratio, goal, "<=")})
    for (mode, wl, conns), row in found.items():  # smallstalk against itself
        plain = found.get((mode, "put", conns))
        if wl != "put-unique" or (plain is None and "plain_put" not in row):
            continue
        keyed_us = _get(row, "smallstalk", "server_cpu_us_per_op")
        if "plain_put" in row:  # measured in the keyed put's own rounds
            plain_us = row["plain_put"].get("server_cpu_us_per_op")
        else:  # a run from before the point had that slot: the put row's
            plain_us = _get(plain, "smallstalk", "server_cpu_us_per_op")
        r = round(keyed_us / plain_us, 3) if keyed_us and plain_us else None
        out.append({"target": "keyed put CPU / plain put CPU", "point": f"{mode}/{wl}/{conns}",
                    "metric": "server_cpu_us_per_op", "smallstalk": keyed_us,
                    "beanstalkd": plain_us, "ratio": r, "goal": f"<= {KEYED_PUT_GOAL}",
                    "met": _met(r, KEYED_PUT_GOAL, "<=")})
    if rss["servers"]:
        r = rss.get("ratio")
        out.append({"target": "RSS per 100-byte job", "point": f"memory/{rss['jobs']} jobs",
                    "metric": "bytes_per_job",
                    "smallstalk": rss["servers"].get("smallstalk", {}).get("bytes_per_job"),
                    "beanstalkd": rss["servers"].get("beanstalkd", {}).get("bytes_per_job"),
                    "ratio": r, "goal": f"<= {RSS_GOAL}", "met": _met(r, RSS_GOAL, "<=")})
    if startup["servers"]:
        r = startup.get("ratio")
        out.append({"target": f"restart with {startup['jobs']:,} jobs", "point": "never/-F",
                    "metric": "ready_s",
                    "smallstalk": startup["servers"].get("smallstalk", {}).get("ready_s"),
                    "beanstalkd": startup["servers"].get("beanstalkd", {}).get("ready_s"),
                    "ratio": r, "goal": f"<= {RESTART_GOAL}",
                    "met": _met(r, RESTART_GOAL, "<=")})
    for mode, m in ((handoff or {}).get("modes") or {}).items():
        for metric in ("p50_us", "p99_us"):
            r = m["ratio"].get(metric)
            out.append({"target": f"hand-off {metric[:3]}", "point": mode, "metric": metric,
                        "smallstalk": m["servers"].get("smallstalk", {}).get(metric),
                        "beanstalkd": m["servers"].get("beanstalkd", {}).get(metric),
                        "ratio": r, "goal": f"<= {HANDOFF_GOAL}",
                        "met": _met(r, HANDOFF_GOAL, "<=")})
    trio_ms = ((spawn or {}).get("import_trio") or {}).get("median_ms")
    for case, c in ((spawn or {}).get("cases") or {}).items():
        ms = c["servers"].get("smallstalk", {}).get("median_ms")
        beyond = None if ms is None or trio_ms is None else round(ms - trio_ms, 1)
        out.append({"target": "spawn to first reply, ms beyond `import trio`", "point": case,
                    "metric": "median_ms", "smallstalk": ms,
                    "beanstalkd": c["servers"].get("beanstalkd", {}).get("median_ms"),
                    "ratio": c.get("ratio"), "beyond_trio_ms": beyond,
                    "goal": f"<= {SPAWN_BEYOND_TRIO_MS:.0f} ms",
                    "met": None if beyond is None else bool(beyond <= SPAWN_BEYOND_TRIO_MS)})
    return out


def _get(row, kind, metric):
    if not row:
        return None
    return row["servers"].get(kind, {}).get(metric)



def ratio_of(servers: dict, key: str):
    a = servers.get("smallstalk", {}).get(key)
    b = servers.get("beanstalkd", {}).get(key)
    if a is None or b is None or not b:
        return None
    return round(a / b, 3)


def ratios(servers: dict) -> dict:
    return {k: ratio_of(servers, k) for k in
            ("ops_per_sec", "server_cpu_us_per_op", "lat_p50_us", "lat_p99_us")}


def _judged_value(t: dict):
    """What a goal is judged on: ms beyond `import trio` for spawn, else the ratio."""
    return t["beyond_trio_ms"] if "beyond_trio_ms" in t else t["ratio"]


def judge_across(runs: list[list[dict]]) -> list[dict]:
    """Several runs' `evaluate_targets` -> one row a goal: each run's value,
    their median, and the goal judged on the median and run by run. On a
    shared machine one run's point can move by tens of per cent (a
    neighbour's burst in one server's round): the median of a few runs says
    more than any one of them. Goals missing from a run count as unmeasured
    there; the rows keep the order the goals first appear in."""
    by_key: dict[tuple[str, str], list] = {}
    goals: dict[tuple[str, str], str] = {}
    for i, targets in enumerate(runs):
        for t in targets:
            key = (t["target"], t["point"])
            by_key.setdefault(key, [None] * len(runs))[i] = _judged_value(t)
            goals[key] = t["goal"]
    out = []
    for key, values in by_key.items():
        cmp, number = goals[key].split()[:2]
        goal = float(number)
        known = [v for v in values if v is not None]
        median = statistics.median(known) if known else None
        out.append({"target": key[0], "point": key[1], "values": values, "median": median,
                    "goal": goals[key], "met": _met(median, goal, cmp),
                    "met_runs": sum(1 for v in known if _met(v, goal, cmp)),
                    "runs": len(known)})
    return out
