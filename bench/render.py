"""The tables of one run's results, as text or markdown (stdout, latest.md, --render)."""

from __future__ import annotations

MODE_LABELS = {
    "memory": "no persistence (no --data-dir / no -b)",
    "never": "smallstalk --data-dir --fsync never  vs  beanstalkd -b DIR -F",
    "always": "smallstalk --data-dir --fsync always  vs  beanstalkd -b DIR -f 0",
}
# Commands an op of each request/response workload sends (bench/loadgen.py's
# COMMANDS_PER_OP has every workload's).
REQ_RESP_COMMANDS = {"put": 1, "rd": 2, "cycle": 3}
WORKLOAD_LABELS = {
    "put": "put",
    "rd": "reserve+delete",
    "cycle": "put+reserve+delete",
    "put-pipe": "put, 100/send",
    "rd-pipe": "reserve+delete, 100/send",
    "put-unique": "put-unique, a new key each",
    "rd-batch": "reserve-batch 100 + deletes 100/send (bs: reserve+delete, 100/send)",
}


def _rounds_note(rounds: int) -> str:
    return f" in {rounds} alternating rounds" if rounds > 1 else ""


def fmt_pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def disk_note(r: dict) -> str:
    v = r.get("disk_fsync_per_sec")
    return f", disk {v:.0f} fsync/s" if v else ""



def _python_note(meta: dict) -> str:
    """`; Python 3.11.7 (x86_64, no PGO/LTO, shared; cbor2 6.3.0 compiled)`, when known."""
    f = meta.get("python_facts")
    if not f:
        return ""
    build = ", ".join(x for x in (
        "PGO" if f["enable_optimizations"] else "no PGO flag",
        "LTO" if f["lto"] else "", "shared libpython" if f["shared"] else "") if x)
    cbor = (f"; cbor2 {f['cbor2']} {'compiled' if f.get('cbor2_compiled') else 'pure Python'}"
            if f.get("cbor2") else "")
    return f"; Python {meta.get('python', '?')} ({f['machine']}, {build}{cbor})"


def fmt_num(x, nd=0, suffix=""):
    if x is None:
        return "-"
    return f"{x:,.{nd}f}{suffix}"


def fmt_rate(x):
    if x is None:
        return "-"
    return f"{x / 1000:.1f}k" if x >= 10_000 else f"{x:,.0f}"


def fmt_us(x):
    if x is None:
        return "-"
    if x >= 10_000:
        return f"{x / 1000:.0f}ms"
    if x >= 1000:
        return f"{x / 1000:.1f}ms"
    return f"{x:.0f}µs"


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}x"



def table(headers: list[str], rows: list[list[str]], markdown: bool, right=None) -> str:
    right = right or set()
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---:" if i in right else "---" for i in range(len(headers)))
                 + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths)]
                     + [fmt(r) for r in rows])


def render(results: dict, markdown: bool) -> str:
    meta = results["meta"]
    ss, bs = "smallstalk", "beanstalkd"
    parts = []
    h = "### " if markdown else "== "
    parts.append(f"{h}smallstalk vs beanstalkd and the floor ({meta['preset']} run, "
                 f"{meta['timestamp']})")
    parts.append(
        f"{meta['nproc']} cores, {meta['duration']} s per point and server"
        f"{_rounds_note(meta.get('rounds', 1))}"
        ", load generator "
        f"{meta['procs']} processes, 100-byte bodies; git {meta['git']['commit'][:10]}"
        f"{' (dirty)' if meta['git']['dirty'] else ''}, smallstalk/ sha256 "
        f"{meta['git']['smallstalk_src_sha256'][:8]}, {meta.get('build', 'pure Python')}; "
        "load average "
        f"{meta['loadavg_range'][0]:.1f}-{meta['loadavg_range'][1]:.1f} during the run"
        f"{_python_note(meta)}. "
        "ratio = smallstalk / beanstalkd (ops/s: higher is better for smallstalk; "
        "µs/op and latency: lower is). Latency is per command in request/response rows, "
        "per 100-command batch in pipelined rows. An op is a put, a job reserved and "
        "deleted, or a job put, reserved and deleted. ss/floor and bs/floor = the "
        "server's CPU per command (an op is 1, 2 or 3 commands) over the floor's CPU "
        "per put at the same connections in this run (bench/floor.py: smallstalk's I/O "
        "shape, no state): the broker's own work.")
    headers = ["mode", "workload", "conns", "ops/s ss", "ops/s bs", "ratio", "µs/op ss",
               "µs/op bs", "ratio", "ss/floor", "bs/floor", "p50 ss", "p50 bs", "p99 ss",
               "p99 bs"]
    right = set(range(2, len(headers)))
    by_mode: dict[str, list] = {}
    for row in results["points"]:
        by_mode.setdefault(row["mode"], []).append(row)
    for mode, rows in by_mode.items():
        cells = []
        for row in rows:
            a, b = row["servers"].get(ss, {}), row["servers"].get(bs, {})
            cells.append([
                mode, WORKLOAD_LABELS.get(row["workload"], row["workload"]), str(row["conns"]),
                _cell_rate(a), _cell_rate(b), fmt_ratio(row["ratio"]["ops_per_sec"]),
                _cell(a, "server_cpu_us_per_op", 1), _cell(b, "server_cpu_us_per_op", 1),
                fmt_ratio(row["ratio"]["server_cpu_us_per_op"]),
                *_floor_cells(row),
                _cell_us(a, "lat_p50_us"), _cell_us(b, "lat_p50_us"),
                _cell_us(a, "lat_p99_us"), _cell_us(b, "lat_p99_us"),
            ])
        parts.append(f"{h}{MODE_LABELS[mode]}" if markdown else f"-- {MODE_LABELS[mode]}")
        probes = sorted(r["disk_fsync_per_sec"] for row in rows
                        for r in row["servers"].values() if r.get("disk_fsync_per_sec"))
        if probes:
            parts.append(f"Disk: {probes[0]:,.0f} / {probes[len(probes) // 2]:,.0f} / "
                         f"{probes[-1]:,.0f} (min / median / max) 4 KiB append+fsync per "
                         "second, probed before each point.")
        parts.append(table(headers, cells, markdown, right))

    floors = results.get("floor") or {}
    if floors:
        cells = [[point, _cell_rate(r), _cell(r, "server_cpu_us_per_op", 2),
                  _cell_us(r, "lat_p50_us"), _cell_us(r, "lat_p99_us"),
                  fmt_num(r.get("client_cpu_pct"), 0)]
                 for point, r in floors.items()]
        title = "The floor (bench/floor.py), saturated: what the ss/floor column divides by"
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["workload/conns", "puts/s", "µs/put", "p50", "p99",
                            "client cpu %"], cells, markdown, {1, 2, 3, 4, 5}))
    parts.extend(_writing_floor(results, h, markdown))
    parts.extend(_user_system(results, h, markdown))

    opened = results.get("open_loop") or []
    if opened:
        cells = []
        for row in opened:
            a, b = row["servers"].get(ss, {}), row["servers"].get(bs, {})
            f = row.get("floor_result") or {}
            cpo = REQ_RESP_COMMANDS.get(row["workload"], 1)
            cells.append([
                WORKLOAD_LABELS.get(row["workload"], row["workload"]), str(row["conns"]),
                fmt_rate(row["offered_cmds_per_sec"]),
                *(fmt_rate(r.get("cmds_per_sec")) if "error" not in r else "ERR"
                  for r in (a, b, f)),
                *(_per_cmd(r, cpo) for r in (a, b)), _per_cmd(f, 1),
                *_floor_cells(row),
                _cell_us(a, "lat_p50_us"), _cell_us(b, "lat_p50_us"),
            ])
        title = ("Open loop, memory: equal offered load below saturation (each connection "
                 f"paced by a timerfd; offered = {_share(meta)} of the slowest server's "
                 "saturated rate at the point in this run); CPU µs per command")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["workload", "conns", "offered cmd/s", "got ss", "got bs",
                            "got floor", "µs/cmd ss", "µs/cmd bs", "µs/put floor", "ss/floor",
                            "bs/floor", "p50 ss", "p50 bs"], cells, markdown,
                           set(range(1, 13))))

    rss = results["rss"]
    if rss["servers"]:
        cells = []
        for kind in (ss, bs):
            r = rss["servers"].get(kind)
            if r is None:
                continue
            if "bytes_per_job" not in r:
                cells.append([kind, "ERROR", r.get("error", "")[:60], "", "", ""])
                continue
            cells.append([kind, f"{r['rss_before_kb'] / 1024:.1f}",
                          f"{r['rss_after_kb'] / 1024:.1f}", f"{r['bytes_per_job']:.0f}",
                          f"{r['mib_per_million_jobs']:.0f}", fmt_rate(r["load_per_sec"])])
        cells.append(["ratio", "", "", fmt_ratio(rss.get("ratio")), "", ""])
        parts.append(f"{h}Memory: RSS for {rss['jobs']:,} jobs of 100 bytes (in memory)"
                     if markdown else
                     f"-- Memory: RSS for {rss['jobs']:,} jobs of 100 bytes (in memory)")
        parts.append(table(["server", "RSS before MiB", "RSS after MiB", "bytes/job",
                            "MiB per 1M jobs", "load puts/s"], cells, markdown,
                           {1, 2, 3, 4, 5}))

    st = results["startup"]
    if st["servers"]:
        cells = []
        for kind in (ss, bs):
            r = st["servers"].get(kind)
            if r is None:
                continue
            if "ready_s" not in r:
                cells.append([kind, "ERROR", r.get("error", "")[:60], "", "", "", "", ""])
                continue
            cells.append([kind, f"{r['port_s']:.2f}", f"{r['ready_s']:.2f}", f"{r['cpu_s']:.2f}",
                          fmt_num(r.get("run_queue_s"), 2), fmt_num(r.get("blocked_s"), 2),
                          f"{r['disk_bytes'] / 2**20:.0f}",
                          f"{r['rss_after_restart_kb'] / 1024:.0f}"])
        cells.append(["ratio", "", fmt_ratio(st.get("ratio")), "", "", "", "", ""])
        title = (f"Restart with {st['jobs']:,} jobs on disk (--fsync never / -F; "
                 "from spawn until the port answers / `stats` shows every job)")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["server", "port s", "all jobs s", "cpu s", "run queue s",
                            "blocked s", "disk MiB", "RSS MiB"], cells, markdown,
                           {1, 2, 3, 4, 5, 6, 7}))

    ho = results.get("handoff") or {}
    if ho.get("modes"):
        cells = []
        for mode, m in ho["modes"].items():
            a, b = m["servers"].get(ss, {}), m["servers"].get(bs, {})
            cells.append([mode] + [_cell(r, k, 0) for k in ("p50_us", "p99_us", "max_us")
                                   for r in (a, b)]
                         + [fmt_ratio(m["ratio"].get(k)) for k in ("p50_us", "p99_us")]
                         + [_cell(r, "server_p50_us", 0) for r in (a, b)]
                         + [fmt_ratio(m["ratio"].get("server_p50_us"))])
        title = (f"Hand-off latency, µs ({ho['samples']:,} samples: a worker waits in "
                 "`reserve`, another connection puts a job; until the worker holds it; "
                 "srv = the server's side, until the RESERVED reached the worker's socket "
                 "(kernel receive stamp); always = --fsync always / -f 0)")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["mode", "p50 ss", "p50 bs", "p99 ss", "p99 bs", "max ss",
                            "max bs", "p50 ratio", "p99 ratio", "srv p50 ss", "srv p50 bs",
                            "srv ratio"], cells, markdown, set(range(1, 12))))
    idle = (ho.get("idle_put") or {}).get("servers") or {}
    if idle:
        fl = idle.get("floor", {})
        cells = []
        for kind in (ss, bs, "floor"):
            if kind in idle:
                r = idle[kind]
                cells.append([kind, _cell(r, "p50_us", 0), _cell(r, "p99_us", 0),
                              fmt_ratio(_div(r.get("p50_us"), idle.get(bs, {}).get("p50_us"))),
                              fmt_ratio(_div(r.get("p50_us"), fl.get("p50_us")))])
        title = ("One put after the hand-off's idle pause, server side, µs (memory; from the "
                 "send until the reply reached the client's socket; the floor: the wake-up "
                 "and the read and write of smallstalk's I/O shape, no state)")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["server", "p50", "p99", "p50 / bs", "p50 / floor"], cells,
                           markdown, {1, 2, 3, 4}))
    sp = results.get("spawn") or {}
    if sp.get("cases"):
        cells = []
        for case, c in sp["cases"].items():
            a, b = c["servers"].get(ss, {}), c["servers"].get(bs, {})
            cells.append([case] + [_cell(r, k, 1) for r in (a, b)
                                   for k in ("median_ms", "max_ms", "cpu_median_ms")]
                         + [fmt_ratio(c.get("ratio"))])
        trio_ms = (sp.get("import_trio") or {}).get("median_ms")
        title = (f"Spawn to first reply, ms (median / max of {sp['samples']} spawns: "
                 "connect with retries, first `stats` answered; cpu = the server's CPU "
                 "time by then, median"
                 + (f"; `python -c 'import trio'` alone: {trio_ms:.0f} ms" if trio_ms else "")
                 + ")")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["case", "ss median", "ss max", "ss cpu", "bs median", "bs max",
                            "bs cpu", "ratio"], cells, markdown, set(range(1, 8))))

    rt = results.get("rate") or {}
    if "accuracy" in rt:
        title = (f"Rate-limited reserves (smallstalk; max-rate {rt['rate']}/s, {rt['conns']} "
                 f"workers, {rt['seconds']:g} s; load {rt['loadavg']:.1f})")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(
            ["steady /s", "accuracy", "past the bound", "µs/job limited", "µs/job unlimited",
             "µs/job loose limit"],
            [[fmt_num(rt["steady_per_sec"], 1), f"{rt['accuracy']:.4f}",
              f"{rt['max_over_bound_jobs']:.2f}", fmt_num(rt["limited_cpu_us_per_job"], 1),
              fmt_num(rt["unlimited_cpu_us_per_job"], 1),
              fmt_num(rt["loose_limit_cpu_us_per_job"], 1)]],
            markdown, set(range(6))))

    cells = []
    for t in results["targets"]:
        def val(v, metric=t["metric"]):
            if v is None:
                return "-"
            return fmt_rate(v) if metric == "ops_per_sec" else f"{v:,.2f}"

        ratio = (fmt_ratio(t["ratio"]) if t.get("beyond_trio_ms") is None
                 else f"{t['beyond_trio_ms']:+.0f} ms")
        if t["metric"] == "vs_floor":
            ratio = fmt_ratio(t["ratio"])
        cells.append([t["target"], t["point"], val(t["smallstalk"]), val(t["beanstalkd"]),
                      ratio, t["goal"],
                      "-" if t["met"] is None else ("yes" if t["met"] else "NO")])
    title = ("Targets (ratio smallstalk/beanstalkd; for \"vs floor\" the smallstalk and "
             "beanstalkd columns are each server's ratio to the floor and the ratio is "
             "smallstalk's; for spawn, ms beyond `import trio`)")
    parts.append(f"{h}{title}" if markdown else f"-- {title}")
    parts.append(table(["target", "point", "smallstalk", "beanstalkd", "ratio", "goal", "met"],
                       cells, markdown, {2, 3, 4}))
    return "\n\n".join(parts) + "\n"


def _writing_floor(results: dict, h: str, markdown: bool) -> list[str]:
    """`--fsync never` rows over the writing floor (bench/floor.py --log) beside the floor."""
    logs = results.get("floor_log") or {}
    rows = [row for row in results["points"] if "vs_floor_log" in row]
    if not logs or not rows:
        return []
    floors = results.get("floor") or {}
    cells = []
    for row in rows:
        f, fl = floors.get(row["floor"], {}), logs.get(row["floor"], {})
        vf, vl = row.get("vs_floor") or {}, row["vs_floor_log"]
        cells.append([WORKLOAD_LABELS.get(row["workload"], row["workload"]), str(row["conns"]),
                      _cell(f, "server_cpu_us_per_op", 2), _cell(fl, "server_cpu_us_per_op", 2),
                      fmt_ratio(vf.get("smallstalk")), fmt_ratio(vl.get("smallstalk")),
                      fmt_ratio(vf.get("beanstalkd")), fmt_ratio(vl.get("beanstalkd"))])
    title = ("`--fsync never` over the writing floor (bench/floor.py --log: the floor "
             "appending each put's record to a log with one write a wake-up, never fsynced)")
    return [f"{h}{title}" if markdown else f"-- {title}",
            table(["workload", "conns", "µs/put floor", "µs/put wfloor", "ss/floor",
                   "ss/wfloor", "bs/floor", "bs/wfloor"], cells, markdown,
                  set(range(2, 8)))]


def _split(r: dict, commands: int) -> tuple:
    """(user, system) µs per command of one server's point, from its CPU and
    the system share of its clock ticks; (None, None) where either is missing."""
    us, share = r.get("server_cpu_us_per_op"), r.get("server_sys_share")
    if "error" in r or us is None or share is None:
        return None, None
    return us / commands * (1 - share), us / commands * share


def _user_system(results: dict, h: str, markdown: bool) -> list[str]:
    """The request/response rows' CPU per command split into user and system
    time, beside the floor's per put: the kernel's share is the I/O shape's,
    and what smallstalk adds above the floor shows in the user column."""
    floors = results.get("floor") or {}
    rows = [row for row in results["points"] if row.get("floor") in floors
            and row["workload"] in REQ_RESP_COMMANDS]
    if not rows:
        return []
    cells = []
    for row in rows:
        n = REQ_RESP_COMMANDS[row["workload"]]
        fu, fs = _split(floors[row["floor"]], 1)
        su, ss = _split(row["servers"].get("smallstalk", {}), n)
        bu, bs = _split(row["servers"].get("beanstalkd", {}), n)
        cells.append([row["mode"], WORKLOAD_LABELS.get(row["workload"], row["workload"]),
                      str(row["conns"]), fmt_num(fu, 1), fmt_num(fs, 1), fmt_num(su, 1),
                      fmt_num(ss, 1), fmt_num(bu, 1), fmt_num(bs, 1),
                      fmt_ratio(_div(su, fu)), fmt_ratio(_div(ss, fs))])
    title = ("User and system CPU per command, µs (request/response rows; the floor's per put "
             "at the same connections; from each point's CPU and its clock ticks' system share)")
    return [f"{h}{title}" if markdown else f"-- {title}",
            table(["mode", "workload", "conns", "floor user", "floor sys", "ss user", "ss sys",
                   "bs user", "bs sys", "ss/floor user", "ss/floor sys"], cells, markdown,
                  set(range(2, 11)))]


def _floor_cells(row: dict) -> list[str]:
    vf = row.get("vs_floor") or {}
    return [fmt_ratio(vf.get("smallstalk")), fmt_ratio(vf.get("beanstalkd"))]


def _per_cmd(r: dict, commands: int) -> str:
    us = r.get("server_cpu_us_per_op")
    return "ERR" if "error" in r else fmt_num(None if us is None else us / commands, 2)


def _share(meta: dict) -> str:
    return f"{100 * meta.get('open_load_share', 0.5):.0f}%"


def _div(a, b):
    return None if a is None or not b else a / b


def _cell(r, key, nd):
    if "error" in r:
        return "ERR"
    return fmt_num(r.get(key), nd)


def _cell_rate(r):
    return "ERR" if "error" in r else fmt_rate(r.get("ops_per_sec"))


def _cell_us(r, key):
    return "ERR" if "error" in r else fmt_us(r.get(key))


def render_across(judged: list[dict], metas: list[dict], markdown: bool) -> str:
    """`targets.judge_across`'s rows: each run's value, the median, the goal,
    and whether the median meets it (with how many runs did); first, what
    each run measured (a median of different trees' runs says so)."""
    stamps = [m["timestamp"] for m in metas]
    trees = {(m["git"].get("smallstalk_src_sha256"), m.get("build")) for m in metas}
    head = [f"{m['timestamp']}: git {str(m['git'].get('commit'))[:10]}, smallstalk/ sha256 "
            f"{m['git'].get('smallstalk_src_sha256')}, {m.get('build')}, "
            f"load {m['loadavg_range'][0]:.1f}-{m['loadavg_range'][1]:.1f}" for m in metas]
    if len(trees) > 1:
        head.append("(the runs measured different code or builds: the median mixes them)")
    rows = []
    for j in judged:
        spawn = j["goal"].endswith("ms")

        def cell(v, spawn=spawn):
            return "-" if v is None else f"{v:+.0f} ms" if spawn else fmt_ratio(v)

        rows.append([j["target"], j["point"], *(cell(v) for v in j["values"]), cell(j["median"]),
                     j["goal"], "-" if j["met"] is None else "yes" if j["met"] else "NO",
                     f"{j['met_runs']} of {j['runs']}"])
    headers = ["target", "point", *stamps, "median", "goal", "median met", "runs met"]
    right = set(range(2, len(headers)))
    sep = "\n\n" if markdown else "\n"
    return sep.join(head) + "\n\n" + table(headers, rows, markdown, right) + "\n"
