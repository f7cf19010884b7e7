"""Public beanstalkd clients' own test suites, against beanstalkd and smallstalk.

The issue: every client test that passes against beanstalkd 1.12 must pass
against smallstalk. For each suite that can be fetched from a package registry
(PyPI, npm) this runs it twice through tests/support/clients/run_suite.py, first
against beanstalkd (the bar) and then against smallstalk, and compares the
outcomes test by test, by name.

The suites are downloaded once into build/client-suites/ (ignored by git) and
reused. Suites that hard-code a port (fivebeans and qbean: 11300) run, as
root, in a network namespace of their own, so a `make run` server or
Debian's beanstalkd.socket on 11300 does not get in the way. A suite that
cannot run (no node/npm, no beanstalkd, a fixed port taken without root,
the registry unreachable) fails; CLIENT_SUITES_LENIENT=1 skips it
instead, with the reason. CLIENT_SUITES_SLOW=1 adds pybeanstalk's 90-second MultiServerConn
tests; CLIENT_SUITES=pystalk,fivebeans picks suites (CLIENT_SUITES=none: none).
About 100 s in all once the suites are cached (two runs of each), most of it
fivebeans' and qbean's own waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..support.procs import REPO

RUNNER = REPO / "tests" / "support" / "clients" / "run_suite.py"
CACHE = REPO / "build" / "client-suites"

EXIT_PASSED, EXIT_FAILED, EXIT_PREREQ, EXIT_FETCH, EXIT_ERROR = 0, 1, 2, 3, 4

# The suites every machine of this project can run: PyPI and npm, Python 3 and
# Node. beanstalkc and pybeanstalk need a Python 2.7 interpreter, which Debian
# 12 no longer packages: run them by hand with CLIENT_SUITES=beanstalkc,... (see
# tests/support/clients/README.md).
SUITES = ["pystalk", "fivebeans", "nodestalker", "qbean"]
if os.environ.get("CLIENT_SUITES_SLOW"):
    SUITES.append("pybeanstalk-multi")
if "CLIENT_SUITES" in os.environ:  # a comma-separated subset; empty or "none" runs none
    SUITES = [s for s in os.environ["CLIENT_SUITES"].split(",") if s and s != "none"]

# By default a suite that cannot run fails: a skip must not stand in for the
# compatibility it proves. CLIENT_SUITES_LENIENT=1 skips instead (offline use).
STRICT = not os.environ.get("CLIENT_SUITES_LENIENT")


def run_suite(suite: str, server: str, tmp_path: Path, timeout: float | None = None) -> dict:
    out = tmp_path / f"{suite}-{server}.json"
    bound = ["--timeout", f"{timeout:.0f}"] if timeout else []
    proc = subprocess.run(
        [sys.executable, str(RUNNER), suite, "--server", server, "--cache", str(CACHE),
         "--json", str(out), *bound],
        capture_output=True,
        text=True,
        timeout=900,  # the runner bounds every step itself; this is a backstop
    )
    if not out.exists():
        pytest.fail(f"run_suite.py {suite} --server {server} wrote no report "
                    f"(exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    report = json.loads(out.read_text())
    code = report["exit_code"]
    if code in (EXIT_PREREQ, EXIT_FETCH) and not STRICT:
        pytest.skip(f"{suite} against {server}: {report['error']}")
    if code not in (EXIT_PASSED, EXIT_FAILED):
        pytest.fail(f"{suite} against {server} did not run: {report['error']}\n"
                    f"{report.get('output_tail', '')}\n{proc.stderr[-3000:]}")
    return report


def outcomes(report: dict) -> dict[str, dict]:
    return {t["name"]: t for t in report["tests"]}


def cut(text: str, n: int = 2500) -> str:
    """The start (the message) and the end (where it broke) of a long detail."""
    text = text.strip()
    if len(text) <= n:
        return text
    head = n // 4
    return text[:head] + "\n[...]\n" + text[-(n - head):]


# Two runs of a whole suite, the first fetching it on a fresh checkout: the
# runner bounds each step, and this outer bound covers both runs.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("suite", SUITES)
def test_client_suite_passes_on_smallstalk_where_it_passes_on_beanstalkd(suite, tmp_path):
    bar_report = run_suite(suite, "beanstalkd", tmp_path)
    bar = [name for name, t in outcomes(bar_report).items() if t["outcome"] == "passed"]
    assert bar, f"no {suite} test passed against beanstalkd: {bar_report['counts']}\n" + cut(
        bar_report.get("output_tail", "")
    )

    # smallstalk gets twice beanstalkd's time plus a margin, so a hung server
    # cannot stretch the run much past the bar's own duration.
    small_report = run_suite(suite, "smallstalk", tmp_path, 2 * bar_report["duration"] + 15)
    ours = outcomes(small_report)
    regressions = []
    for name in bar:
        t = ours.get(name)
        if t is None:
            regressions.append(f"- {name}: passes on beanstalkd, did not run on smallstalk")
        elif t["outcome"] != "passed":
            regressions.append(
                f"- {name}: passes on beanstalkd, {t['outcome']} on smallstalk:\n    "
                + cut(t["detail"]).replace("\n", "\n    ")
            )
    if regressions:
        # Failures under names beanstalkd's run does not have (a fixture's
        # setup error, a crashed run) usually explain the tests that did not run.
        theirs = outcomes(bar_report)
        for name, t in ours.items():
            if name not in theirs and t["outcome"] not in ("passed", "skipped"):
                regressions.append(
                    f"- {name} (only in smallstalk's run): {t['outcome']}:\n    "
                    + cut(t["detail"]).replace("\n", "\n    ")
                )
        if small_report.get("error"):
            regressions.append(f"- the run itself: {small_report['error']}")
        small_log = ""
        if small_report.get("server_log"):
            small_log = "\nsmallstalk's log (a server the runner started):\n" + cut(
                small_report["server_log"], 3000
            )
        missing = sum(1 for name in bar if ours.get(name, {}).get("outcome") != "passed")
        pytest.fail(
            f"{missing} of the {len(bar)} {suite} tests that pass against beanstalkd "
            f"fail against smallstalk ({bar_report['package']}):\n"
            + "\n".join(regressions)
            + small_log,
            pytrace=False,
        )
