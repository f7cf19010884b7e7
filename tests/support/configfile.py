"""Helpers of the configuration tests: write a file, run `config dump`, read its YAML."""

from __future__ import annotations

import io
from pathlib import Path

from smallstalk.ops import config_dump as configcmd


def write(tmp_path: Path, text: str, name: str = "smallstalk.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse_yaml(body: bytes) -> dict[str, dict[str, str]]:
    """policy.render's YAML (`tube:` then `  key: value`) as nested dicts."""
    lines = body.decode().splitlines()
    assert lines[0] == "---", body
    out: dict[str, dict[str, str]] = {}
    tube = None
    for line in lines[1:]:
        if not line.startswith(" "):
            tube = line.removesuffix(":").strip('"')
            out[tube] = {}
        else:
            key, _, value = line.strip().partition(": ")
            out[tube][key] = value.strip('"')
    return out


def run_dump(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = configcmd.main(["dump", *argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()
