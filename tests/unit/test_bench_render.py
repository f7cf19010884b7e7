"""bench/render.py's split of CPU per command into user and system time: the
kernel's share of a request/response command is the I/O shape's, so the
table puts each server's user and system microseconds beside the floor's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _render():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # render.py imports its siblings by name
    spec = importlib.util.spec_from_file_location("bench_render", BENCH / "render.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _render()


def _point(cpu: float, share: float | None) -> dict:
    return {"server_cpu_us_per_op": cpu, "server_sys_share": share}


def test_user_and_system_per_command_beside_the_floor() -> None:
    results = {
        "floor": {"put/10": _point(12.0, 0.75)},  # 3 µs user, 9 µs system a put
        "points": [
            # a reserve+delete is two commands: 40 µs an op, a quarter system
            {"mode": "memory", "workload": "rd", "conns": 10, "floor": "put/10",
             "servers": {"smallstalk": _point(40.0, 0.25), "beanstalkd": {"error": "down"}}},
            # pipelined rows and rows without a floor point are not request/response
            {"mode": "memory", "workload": "put-pipe", "conns": 10, "floor": "put/10",
             "servers": {"smallstalk": _point(2.0, 0.1)}},
            {"mode": "memory", "workload": "put", "conns": 1, "floor": "put/1",
             "servers": {"smallstalk": _point(80.0, 0.5)}},
        ],
    }
    title, tab = render._user_system(results, "### ", True)
    assert title.startswith("### User and system CPU per command")
    rows = tab.splitlines()[2:]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells == ["memory", "reserve+delete", "10", "3.0", "9.0", "15.0", "5.0", "-", "-",
                     "5.00x", "0.56x"]


def test_a_run_without_the_floor_has_no_such_table() -> None:
    assert render._user_system({"points": [], "floor": {}}, "### ", True) == []
    point = {"mode": "memory", "workload": "put", "conns": 10, "floor": "put/10",
             "servers": {"smallstalk": _point(10.0, None)}}
    _, tab = render._user_system({"floor": {"put/10": _point(12.0, 0.75)}, "points": [point]},
                                 "", False)
    assert tab.splitlines()[2].split()[3:] == ["3.0", "9.0", "-", "-", "-", "-", "-", "-"]
