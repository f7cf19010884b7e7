"""The goals judged on the median of several benchmark runs (bench/targets.py's
`judge_across`, bench/render.py's `render_across`): one run on a shared
machine can move a point by tens of per cent, so the verdict is the median's,
with how many runs met each goal beside it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # render.py imports its siblings by name
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


targets = _module("targets")
render = _module("render")


def _t(target: str, point: str, ratio, goal: str, **extra) -> dict:
    return {"target": target, "point": point, "ratio": ratio, "goal": goal, **extra}


RUNS = [
    [_t("vs floor", "never/put/10", 1.8, "<= 1.6"), _t("req/resp", "memory/put/1", 0.5, ">= 0.6"),
     _t("spawn", "no data dir", 70.0, "<= 40 ms", beyond_trio_ms=35.0)],
    [_t("vs floor", "never/put/10", 1.2, "<= 1.6"),
     _t("spawn", "no data dir", 60.0, "<= 40 ms", beyond_trio_ms=87.0)],
    [_t("vs floor", "never/put/10", 1.5, "<= 1.6"), _t("req/resp", "memory/put/1", 0.7, ">= 0.6"),
     _t("spawn", "no data dir", 65.0, "<= 40 ms", beyond_trio_ms=51.0),
     _t("hand-off p50", "memory", None, "<= 1.5")],
]


def test_each_goal_is_judged_on_the_median_of_the_runs_that_measured_it() -> None:
    judged = {(j["target"], j["point"]): j for j in targets.judge_across(RUNS)}
    floor = judged["vs floor", "never/put/10"]
    assert floor["values"] == [1.8, 1.2, 1.5]
    assert (floor["median"], floor["met"], floor["met_runs"], floor["runs"]) == (1.5, True, 2, 3)
    # Missing from a run: unmeasured there, and the median is of the two that have it.
    rr = judged["req/resp", "memory/put/1"]
    assert rr["values"] == [0.5, None, 0.7]
    assert abs(rr["median"] - 0.6) < 1e-9 and rr["met"] and (rr["met_runs"], rr["runs"]) == (1, 2)
    # Spawn is judged on the milliseconds beyond `import trio`, not the ratio.
    spawn = judged["spawn", "no data dir"]
    assert spawn["values"] == [35.0, 87.0, 51.0]
    assert (spawn["median"], spawn["met"], spawn["met_runs"]) == (51.0, False, 1)
    # A goal no run could judge stays undecided.
    none = judged["hand-off p50", "memory"]
    assert (none["median"], none["met"], none["runs"]) == (None, None, 0)


def test_the_goals_keep_the_first_run_s_order() -> None:
    assert [(j["target"], j["point"]) for j in targets.judge_across(RUNS)] == [
        ("vs floor", "never/put/10"), ("req/resp", "memory/put/1"), ("spawn", "no data dir"),
        ("hand-off p50", "memory")]


def _meta(stamp: str, sha: str) -> dict:
    return {"timestamp": stamp, "git": {"commit": "c7294d43c3aa", "smallstalk_src_sha256": sha},
            "build": "compiled", "loadavg_range": [0.6, 2.1]}


def test_the_table_names_each_run_and_says_when_they_measured_different_code() -> None:
    judged = targets.judge_across(RUNS)
    metas = [_meta("A", "1111"), _meta("B", "1111"), _meta("C", "1111")]
    text = render.render_across(judged, metas, markdown=True)
    assert "| target | point | A | B | C | median | goal | median met | runs met |" in text
    assert "| vs floor | never/put/10 | 1.80x | 1.20x | 1.50x | 1.50x | <= 1.6 | yes | 2 of 3 |" \
        in text
    assert "| spawn | no data dir | +35 ms | +87 ms | +51 ms | +51 ms | <= 40 ms | NO | 1 of 3 |" \
        in text
    assert "| req/resp | memory/put/1 | 0.50x | - | 0.70x | 0.60x | >= 0.6 | yes | 1 of 2 |" in text
    assert "different code" not in text
    metas[1] = _meta("B", "2222")
    assert "different code" in render.render_across(judged, metas, markdown=False)


def test_a_file_that_is_no_run_gets_one_line(tmp_path: Path) -> None:
    """`--across` (and `--render`) name the file and say what it should be."""
    other = tmp_path / "other.json"
    other.write_text('{"not": "a run"}')
    for args, says in ((["--across", str(tmp_path / "missing.json")], "cannot read"),
                       (["--across", str(other)], "is not a bench/run.py results file"),
                       (["--render", str(other)], "is not a bench/run.py results file")):
        proc = subprocess.run([sys.executable, str(BENCH / "run.py"), *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
