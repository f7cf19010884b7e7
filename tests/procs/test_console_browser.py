"""The operator console in a real browser (Debian's Chromium through Selenium),
against a real server process holding real jobs; `/metrics` read back with
prometheus_client's own parser.

Skipped only where the browser or the console extra is not installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import greenstalk
import pytest

from ..support.procs import REPO, free_port, start_smallstalk, wait_for, wait_for_log

pytest.importorskip("hypercorn")
prom_parser = pytest.importorskip("prometheus_client.parser")
webdriver = pytest.importorskip("selenium.webdriver")
if not (shutil.which("chromium") and shutil.which("chromedriver")):
    pytest.skip("Debian's chromium and chromium-driver are not installed",
                allow_module_level=True)

from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

# The screenshots docs/img holds: written there only when asked
# (SMALLSTALK_SCREENSHOTS=docs/img), so that a test run leaves the tree as it was.
IMG = (REPO / os.environ["SMALLSTALK_SCREENSHOTS"] if os.environ.get("SMALLSTALK_SCREENSHOTS")
       else Path(tempfile.gettempdir()) / "smallstalk-screenshots")


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    http = free_port()
    srv = start_smallstalk(tmp, "--http", f"127.0.0.1:{http}", "--no-compact", "--extended-stats",
                           data_dir=tmp / "data")
    try:
        wait_for_log(srv.log_path, "console on http://", srv.proc)
        yield srv, f"http://127.0.0.1:{http}"
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    opts = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.binary_location = "/usr/bin/chromium"
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def client(srv) -> greenstalk.Client:
    return greenstalk.Client(("127.0.0.1", srv.port))


def text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def landed(driver, check) -> None:
    """After a click that navigates: wait until `check(driver)` holds on the
    new page (the click may return while the old page is still shown)."""
    WebDriverWait(driver, 30, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException)).until(check)


def screenshot(driver, name: str, height: int) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    driver.set_window_size(1400, height)
    driver.save_screenshot(str(IMG / name))
    driver.set_window_size(1400, 1000)


def test_every_page_opens(console, browser) -> None:
    srv, url = console
    with client(srv) as c:
        c.use("pages")
        first = c.put("page job 1")
        c.put("page job 2", delay=600)
        c.watch("pages")
        c.bury(c.reserve(timeout=5))
    pages = {
        "/": "#jobs-ready", "/tubes": "#tubes", "/tube/pages": "#jobs",
        "/tube/pages?state=buried": "#jobs", "/tube/pages?state=delayed": "#jobs",
        f"/job/{first}": "#timeline", "/travel": "#travel-form", "/travel?seq=3": "#at-seq",
        "/replication": "#replicas", "/report": "h1", "/cluster": "h1",
    }
    for path, css in pages.items():
        browser.get(url + path)
        assert browser.find_element(By.CSS_SELECTOR, css).is_displayed(), path
        assert "Internal Server Error" not in browser.page_source, path
    browser.get(url + "/tubes?q=pag")
    names = [e.get_attribute("data-tube") for e in browser.find_elements(By.CSS_SELECTOR,
                                                                        "#tubes tbody tr")]
    assert names == ["pages"]
    browser.get(url + "/")
    assert text(browser, "#role") == "primary"
    assert int(text(browser, "#jobs-buried")) >= 1
    with client(srv) as c:  # beanstalkd's names may hold '/', ';', '$', '(' and ')'
        c.use("jobs/out;v2$(x)")
        c.put("odd name")
    browser.get(url + "/tubes?q=jobs/")
    browser.find_element(By.LINK_TEXT, "jobs/out;v2$(x)").click()
    landed(browser, lambda d: d.find_element(By.TAG_NAME, "h1").text == "Tube jobs/out;v2$(x)")
    assert text(browser, "#count-ready") == "1"
    browser.get(url + "/travel?seq=abc")
    assert text(browser, "#travel-error") == "seq must be a whole number, not 'abc'"


def test_kick_a_buried_job_with_the_button(console, browser) -> None:
    srv, url = console
    with client(srv) as c:
        c.use("kicks")
        c.watch("kicks")
        c.ignore("default")
        for i in range(2):
            c.put(f"kick me {i}")
        for _ in range(2):
            buried = c.reserve(timeout=5)
            c.bury(buried)
    browser.get(url + f"/job/{buried.id}")  # the job page says why it does not run
    assert text(browser, "#explain") == (
        f"buried (buried 1 times); `kick-job {buried.id}` makes it ready")
    browser.get(url + "/tube/kicks?state=buried")
    assert text(browser, "#count-buried") == "2"
    assert text(browser, "#count-ready") == "0"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr[data-job]")) == 2
    browser.find_element(By.ID, "kick").click()
    wait_for(lambda: "KICKED" in browser.page_source, 30, "the kick's answer")
    assert text(browser, "#msg") == "kick kicks: USING kicks / KICKED 2"
    assert text(browser, "#count-buried") == "0"
    assert text(browser, "#count-ready") == "2"
    with client(srv) as c:
        assert c.stats_tube("kicks")["current-jobs-ready"] == 2


def test_search_then_a_confirmed_bulk_move_and_delete(console, browser) -> None:
    srv, url = console
    with client(srv) as c:
        c.use("searched")
        orders = [c.put(f"order {i}") for i in range(5)]
        c.put("invoice 1")
    browser.get(url + "/tube/searched")
    browser.find_element(By.ID, "search-q").send_keys("order")
    browser.find_element(By.ID, "search").click()
    # The click submits the form: the page with the matches loads after it returns.
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#matches"), 30, "the matches")
    assert text(browser, "#matches") == "5"
    rows = [int(e.get_attribute("data-job"))
            for e in browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr[data-job]")]
    assert rows == orders
    # A regular expression; a result links to its job's page.
    browser.get(url + "/tube/searched?state=ready&how=regex&q=" + urllib.parse.quote("^order [34]$"))
    assert text(browser, "#matches") == "2"
    browser.find_element(By.LINK_TEXT, str(orders[3])).click()
    landed(browser, lambda d: d.find_element(By.TAG_NAME, "h1").text.startswith(
        f"Job {orders[3]}"))
    browser.back()
    # Move the two matches away: the page acts on at most the count it showed.
    browser.find_element(By.ID, "bulk-to").send_keys("searched-done")
    browser.find_element(By.ID, "bulk-move").click()
    browser.switch_to.alert.accept()
    wait_for(lambda: "ACTED" in browser.page_source, 30, "the move's answer")
    assert text(browser, "#msg") == "bulk searched: ACTED 2"
    assert text(browser, "#matches") == "0"
    # Count, then a job that matches arrives, then the confirmed delete: it
    # deletes the counted number (the lowest ids), not the newcomer.
    browser.get(url + "/tube/searched?state=ready&how=substr&q=order")
    assert text(browser, "#matches") == "3"
    with client(srv) as c:
        c.use("searched")
        late = c.put("order late")
    browser.find_element(By.ID, "bulk-delete").click()
    browser.switch_to.alert.accept()
    wait_for(lambda: "ACTED" in browser.page_source, 30, "the delete's answer")
    assert text(browser, "#msg") == "bulk searched: ACTED 3"
    rows = [int(e.get_attribute("data-job"))
            for e in browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr[data-job]")]
    assert rows == [late]
    with client(srv) as c:
        assert c.stats_tube("searched")["current-jobs-ready"] == 2  # the late order, the invoice
        assert c.stats_tube("searched-done")["current-jobs-ready"] == 2
    # A bad pattern is one line on the page.
    browser.get(url + "/tube/searched?state=ready&how=regex&q=" + urllib.parse.quote("("))
    assert text(browser, "#search-error").startswith("BAD_SEARCH bad regular expression")


def test_job_timeline_after_a_release_and_a_ttr_timeout(console, browser) -> None:
    srv, url = console
    with client(srv) as c:
        c.use("timeline")
        c.watch("timeline")
        c.ignore("default")
        jid = c.put("send the welcome mail", ttr=1)
        c.release(c.reserve(timeout=5), delay=0)
        c.reserve(timeout=5)  # and let its TTR run out
        wait_for(lambda: c.stats_job(jid)["timeouts"] == 1, 30, "the TTR timeout")
    browser.get(url + f"/job/{jid}")
    events = [e.get_attribute("data-event")
              for e in browser.find_elements(By.CSS_SELECTOR, "#timeline li")]
    assert events[:5] == ["put", "reserve", "release", "reserve", "timeout"]
    assert "TTR (1s) ran out" in text(browser, "#timeline")
    assert text(browser, "#body") == "send the welcome mail"
    browser.get(url + f"/job/{jid}?view=hex")
    assert text(browser, "#body").startswith("00000000  73 65 6e 64")
    browser.get(url + f"/job/{jid}")
    screenshot(browser, "console-job-timeline.png", 1250)


def test_travel_back_to_before_a_burst(console, browser) -> None:
    srv, url = console
    with client(srv) as c:
        c.use("burst")
        c.put("before the burst")
        before = int(c.stats()["last-seq"])
        for i in range(20):
            c.put(f"burst {i}")
        assert c.stats_tube("burst")["current-jobs-ready"] == 21
    browser.get(url + f"/travel?seq={before}")
    assert text(browser, "#at-seq") == str(before)
    row = browser.find_element(By.CSS_SELECTOR, '#travel-tubes tr[data-tube="burst"]')
    assert row.find_element(By.CSS_SELECTOR, ".ready").text == "1"
    browser.find_element(By.ID, "next").click()  # one record later: one more job
    landed(browser, lambda d: text(d, "#at-seq") == str(before + 1))
    row = browser.find_element(By.CSS_SELECTOR, '#travel-tubes tr[data-tube="burst"]')
    assert row.find_element(By.CSS_SELECTOR, ".ready").text == "2"
    browser.get(url + "/travel?seq=999999999")
    assert "999999999" in text(browser, "#travel-error")


def test_a_write_without_the_csrf_token_is_refused(console, browser) -> None:
    srv, url = console
    with client(srv) as c:
        c.use("guarded")
        c.watch("guarded")
        c.ignore("default")
        c.put("keep me")
        c.bury(c.reserve(timeout=5))
    # A forged form from elsewhere: no cookie, no token.
    data = urllib.parse.urlencode({"count": "5"}).encode()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/do/kick/guarded", data=data, timeout=30)
    assert e.value.code == 403
    # The browser's own cookie, but the form's token taken out.
    browser.get(url + "/tube/guarded?state=buried")
    browser.execute_script(
        "document.querySelectorAll('input[name=csrf]').forEach(e => e.value = 'forged')")
    browser.find_element(By.ID, "kick").click()
    landed(browser, lambda d: "CSRF token is missing or wrong" in text(d, "#refused"))
    with client(srv) as c:
        assert c.stats_tube("guarded")["current-jobs-buried"] == 1


def test_metrics_parse_with_prometheus_clients_parser(console, browser) -> None:
    srv, url = console
    with client(srv) as c:
        c.use("metered")
        for i in range(3):
            c.put(f"m {i}")
        stats = c.stats()
    body = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    fams = {f.name: f for f in prom_parser.text_string_to_metric_families(body)}
    value = {f: fams[f].samples[0].value for f in ("beanstalkd_total_jobs",
                                                   "beanstalkd_current_tubes")}
    assert value["beanstalkd_total_jobs"] >= stats["total-jobs"]
    ready = {s.labels["tube"]: s.value for s in fams["beanstalkd_tube_current_jobs_ready"].samples}
    assert ready["metered"] == 3
    fsync = {s.name: s.value for s in fams["smallstalk_fsync_seconds"].samples}
    assert fsync["smallstalk_fsync_seconds_count"] > 0
    assert fams["smallstalk_commit_records"].type == "histogram"
    assert fams["smallstalk_aof_segments"].samples[0].value >= 1
    info = fams["smallstalk_info"].samples[0].labels
    assert info["role"] == "primary" and info["protocol"] == "1.12"
    # The overview, for the README, once the rate sampler has a few samples.
    wait_for(lambda: "Collecting samples" not in
             urllib.request.urlopen(url + "/", timeout=30).read().decode(), 30, "rate samples")
    browser.get(url + "/")
    screenshot(browser, "console-overview.png", 900)


def test_an_unusable_http_address_is_one_line(tmp_path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "smallstalk", "serve", "-l", "127.0.0.1", "-p",
             str(free_port()), "--http", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 111  # as for -p (docs/OPERATIONS.md's exit statuses)
    assert out.stderr.strip().splitlines() == [
        f"smallstalk: --http 127.0.0.1:{port}: cannot listen there (Address already in use)"]


def test_the_broker_does_not_load_the_console_unless_asked() -> None:
    probe = ("import sys, smallstalk.cli, smallstalk.config as c; "
             "cfg = c.parse_serve(['-p', '1']); "
             "print(cfg.http, sorted(m for m in ('hypercorn', 'starlette', 'jinja2', "
             "'prometheus_client', 'smallstalk.console') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=True)
    assert out.stdout.split() == ["None", "[]"]


def synthetic_report(hours: int = 6) -> str:
    """An analytics HTML report for many busy tubes, whose data ends mid-hour."""
    from smallstalk.analytics import report

    ns, t0 = 10**9, 1_790_000_000 * 10**9
    end = t0 + hours * 3600 * ns + 1200 * ns  # 20 minutes into the last hour
    tubes, series = [], {}
    for i in range(12):
        name = f"notifications-{i:02d}.email"
        tubes.append({
            "tube": name, "jobs": 12_345_678, "deleted": 12_300_000, "open": 45_678,
            "reserves": 13_456_789, "reserved_more_than_once": 123_456, "timeouts": 98_765,
            "releases": 87_654, "buries": 7_654, "expired": 6_543, "discarded": 5_432,
            "wait_p50_ms": 0.0, "wait_p95_ms": 1520.0, "wait_p99_ms": 7_500_000.0,
            "run_p50_ms": 12.4, "run_p95_ms": 65_000.0, "run_p99_ms": 600_000.0,
            "max_ready": 1_234_567, "max_ready_at": "2026-09-21 13:00", "timeouts_rate": 0.01,
            "releases_rate": 0.02, "buries_rate": 0.001})
        series[name] = [
            {"window_ns": t0 + h * 3600 * ns, "ready": 100, "delayed": 5, "reserved": 10,
             "buried": 1, "puts": 50_000 if h < hours else 15_000, "deletes": 49_000,
             "reserves": 50_500, "wait_p50_ms": 0.0, "wait_p95_ms": 3.0, "wait_p99_ms": 9.0,
             "run_p50_ms": 1.0, "run_p95_ms": 2.0, "run_p99_ms": 3.0}
            for h in range(hours + 1)]
    servers = [{"server": "broker-1", "records": 98_765_432, "segments": 1234, "first_seq": 1,
                "last_seq": 98_765_432, "first_ns": t0, "last_ns": end,
                "snapshot_jobs": 0, "restarts": 3, "missing": 0}]
    return report.html_report({"tubes": tubes, "servers": servers}, series, "hour")


def test_the_analytics_report_fits_1400_pixels(console, browser) -> None:
    srv, url = console
    reports = srv.data_dir / "reports"
    reports.mkdir(exist_ok=True)
    (reports / "latest.html").write_text(synthetic_report())
    browser.get(url + "/")
    browser.find_element(By.LINK_TEXT, "Report").click()
    landed(browser, lambda d: d.title == "smallstalk job analytics")
    widths = browser.execute_script(
        "const t = document.querySelector('.wide table');"
        "return [document.documentElement.scrollWidth, window.innerWidth,"
        "        t.scrollWidth, t.parentElement.clientWidth];")
    assert widths[0] <= widths[1] <= 1400, widths  # the page does not scroll sideways
    assert widths[2] <= widths[3], widths  # and the tubes table fits without its scroll bar
    cells = [td.text for td in browser.find_elements(By.CSS_SELECTOR, ".wide tbody tr td")]
    assert "0ms" in cells  # a zero wait p50 keeps its unit
    assert "the last hour, which the data ends inside, is left out" in browser.page_source


def test_list_jobs_and_flush_tube_in_smallstalk_client(console) -> None:
    from smallstalk.client import Client, NotFound

    srv, _url = console
    with Client(f"127.0.0.1:{srv.port}") as c:
        c.use("listed")
        ids = [c.put(f"l{i}", priority=pri).id for i, pri in enumerate((9, 1, 5, 1))]
        assert c.list_jobs("listed") == [ids[1], ids[3], ids[2], ids[0]]
        assert c.list_jobs("listed", after=ids[3], count=1) == [ids[2]]
        assert c.list_jobs("listed", "buried") == []
        c.bury(c.reserve(timeout=5, tubes=["listed"]))
        assert c.list_jobs("listed", "buried") == [ids[1]]
        assert c.flush_tube("listed") == 4
        assert c.list_jobs("listed") == []
        with pytest.raises(NotFound):
            c.flush_tube("no-such-tube")
        with pytest.raises(ValueError):
            c.list_jobs("listed", "waiting")


def test_a_replicas_console(tmp_path, console) -> None:
    primary, _ = console
    http = free_port()
    replica = start_smallstalk(tmp_path, "--replica-of", f"127.0.0.1:{primary.port}",
                               "--http", f"127.0.0.1:{http}", data_dir=tmp_path / "replica")
    try:
        wait_for_log(replica.log_path, "console on http://", replica.proc)
        url = f"http://127.0.0.1:{http}"

        def page(path: str) -> str:
            return urllib.request.urlopen(url + path, timeout=30).read().decode()

        wait_for(lambda: "<td>connected</td>" in page("/replication"), 30, "the replica to connect")
        fams = {f.name: f for f in prom_parser.text_string_to_metric_families(page("/metrics"))}
        assert fams["smallstalk_info"].samples[0].labels["role"] == "replica"
        assert fams["smallstalk_replication_connected"].samples[0].value == 1
        # A change from the replica's console is answered READ_ONLY, like a client's.
        with urllib.request.urlopen(url + "/tube/default", timeout=30) as r:
            cookie = r.headers["Set-Cookie"].split(";")[0]
            token = cookie.split("=", 1)[1]
        req = urllib.request.Request(
            url + "/do/pause/default", data=urllib.parse.urlencode(
                {"csrf": token, "seconds": "5"}).encode(), headers={"Cookie": cookie})
        with urllib.request.urlopen(req, timeout=30) as r:
            status, body = r.status, r.read().decode()
        assert status == 200 and "READ_ONLY" in body
    finally:
        replica.stop()


def test_a_worker_task_body_is_decoded(console, browser) -> None:
    from smallstalk.worker import encode_call

    srv, url = console
    with client(srv) as c:
        c.use("tasks")
        jid = c.put(encode_call("mail.send_welcome", ["ada@example.org"], {"retry": True}))
    browser.get(url + f"/job/{jid}")
    browser.find_element(By.LINK_TEXT, "task").click()
    landed(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#body td"))
    cells = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "#body td")]
    assert cells == ["mail.send_welcome", "['ada@example.org']", "{'retry': True}"]


def test_travel_says_when_the_history_was_compacted_away(tmp_path, browser) -> None:
    http = free_port()
    srv = start_smallstalk(tmp_path, "--http", f"127.0.0.1:{http}", "--segment-records", "5",
                           "--compact-segments", "1", data_dir=tmp_path / "data")
    try:
        wait_for_log(srv.log_path, "console on http://", srv.proc)
        with client(srv) as c:
            for i in range(30):
                c.put(f"c{i}")
        wait_for(lambda: "compacted" in srv.log(), 60, "a compaction")
        browser.get(f"http://127.0.0.1:{http}/travel?seq=3")
        assert "no longer in the log" in text(browser, "#travel-error")
        assert not browser.find_elements(By.ID, "travel-tubes")
    finally:
        srv.stop()
