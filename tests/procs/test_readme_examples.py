"""Every shell and Python example in README.md runs as written.

The README's examples talk to `make run`'s server on 127.0.0.1:11300 and call
`.venv/bin/...` from the checkout. So that they run unchanged (no port
substituted) while something else may hold 11300 on this host, the examples
run in a network namespace of their own (`unshare -n`, root), in a scratch
directory whose `.venv` is the environment running the tests, beside a
server started as `make run` starts it: `smallstalk serve -l 127.0.0.1 -p 11300
--data-dir data`. Blocks run in README order (the quick start puts job 1,
which the next block looks at), each with bash (```sh) or the venv's python
(```python), and must exit 0 without a traceback.

Not run: blocks of other languages (```console transcripts, ```text output,
```toml), the example between `<!-- example -->` markers
(tests/procs/test_worker.py runs it), and a block right after
`<!-- readme-test: skip: REASON -->`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = {"sh": ["bash", "-e", "-o", "pipefail"], "python": [".venv/bin/python"]}
SKIP = re.compile(r"<!-- readme-test: skip: (.+?) -->\n$")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
PORT = 11300


def blocks(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(language, code) of the blocks to run, and the reasons of those skipped."""
    run, skipped = [], []
    example = (text.index("<!-- example -->"), text.index("<!-- /example -->")) \
        if "<!-- example -->" in text else (-1, -1)
    for m in FENCE.finditer(text):
        lang, code = m[1], m[2]
        if lang not in RUN:
            continue
        if example[0] < m.start() < example[1]:
            skipped.append("tests/procs/test_worker.py")
            continue
        before = SKIP.search(text, 0, m.start())
        if before and before.end() == m.start():
            skipped.append(before[1])
            continue
        run.append((lang, code))
    return run, skipped


def test_the_readme_has_examples_to_run() -> None:
    run, skipped = blocks((REPO / "README.md").read_text())
    assert len(run) >= 3
    assert all(reason.strip() for reason in skipped)
    assert any("greenstalk" in code for _, code in run)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a network namespace of its own needs root and unshare(1)")
def test_readme_examples_run_as_written() -> None:
    run, _ = blocks((REPO / "README.md").read_text())
    work = Path(tempfile.mkdtemp(prefix="smallstalk-readme-"))
    try:
        (work / ".venv").symlink_to(Path(sys.prefix))
        (work / "blocks.json").write_text(json.dumps(run))
        proc = subprocess.run(["unshare", "-n", sys.executable, __file__, str(work)],
                              capture_output=True, text=True, timeout=600, cwd=work)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        results = json.loads((work / "results.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert len(results) == len(run)
    for (lang, code), result in zip(run, results, strict=True):
        output = result["output"]
        where = f"```{lang}\n{code}```\nexit {result['status']}:\n{output}"
        assert result["status"] == 0, where
        assert "Traceback" not in output, where
    said = {code: r["output"] for (_, code), r in zip(run, results, strict=True)}
    assert any(out.startswith("True send welcome mail") for code, out in said.items()
               if "greenstalk" in code)
    assert all("PROMOTED" in out for code, out in said.items() if "smallstalk promote" in code)
    assert all("emails" in out for code, out in said.items() if "job-history data 1" in code)


# --- inside the namespace ---------------------------------------------------------------


def _serve(work: Path) -> subprocess.Popen:
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen([".venv/bin/python", "-m", "smallstalk", "serve", "-l", "127.0.0.1",
                             "-p", str(PORT), "--data-dir", "data"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=work)
    deadline = time.monotonic() + 60
    while b"listening on" not in (work / "server.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start:\n{(work / 'server.log').read_text()}")
        time.sleep(0.02)
    return proc


def _run_block(work: Path, lang: str, code: str) -> dict:
    script = work / ("block.sh" if lang == "sh" else "block.py")
    script.write_text(code)
    proc = subprocess.Popen([*RUN[lang], str(script)], cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        status, out = "timeout", b""
    finally:
        try:  # what the block left running in its session (it started it)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"status": status, "output": out.decode(errors="replace") if out else ""}


def main(work: Path) -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with socket.socket() as s:  # the namespace is ours: 11300 is free
        s.bind(("127.0.0.1", PORT))
    server = _serve(work)
    try:
        results = [_run_block(work, lang, code)
                   for lang, code in json.loads((work / "blocks.json").read_text())]
    finally:
        server.kill()
        server.wait()
    (work / "results.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
