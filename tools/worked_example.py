"""Rewrite the worked example in snapshots/README.md from the current fixture.

Run after generating fixtures of a new version: `python tools/worked_example.py`.
tests/unit/test_format.py checks that the example matches the fixture byte for byte.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import cbor2

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["code 1: put", "seq", "time", "conn", "id", "tube", "pri", "delay", "ttr", "body"]


def hexdump(segment: Path) -> str:
    d = segment.read_bytes()
    lines: list[str] = []

    def add(b: bytes, comment: str) -> None:
        lines.append(f"{' '.join(f'{x:02x}' for x in b):<40}# {comment}")

    add(d[0:8], "magic SSTKAOF\\0")
    add(d[8:12], f"version {struct.unpack_from('<I', d, 8)[0]}")
    add(d[12:20], f"first seq {struct.unpack_from('<Q', d, 12)[0]}")
    add(d[20:24], f"CRC-32 of the 20 bytes above: 0x{struct.unpack_from('<I', d, 20)[0]:08x}")
    length, crc = struct.unpack_from("<II", d, 24)
    add(d[24:28], f"frame: payload length {length}")
    add(d[28:32], f"CRC-32 of the payload: 0x{crc:08x}")
    payload = d[32:32 + length]
    rec = cbor2.loads(payload)
    add(payload[0:1], f"CBOR array of {len(rec)}")
    pos = 1
    for i, (value, name) in enumerate(zip(rec, NAMES, strict=True)):
        enc = cbor2.dumps(value)
        if i == 0:
            comment = name
        elif name == "time":
            comment = f"time {value} ns"
        elif name == "tube":
            comment = f'tube: text({len(value)}) "{value}"'
        elif name == "body":
            comment = f'body: bytes({len(value)}) "{value.decode()}"'
        else:
            comment = f"{name} {value}"
        add(enc, comment)
        pos += len(enc)
    return "\n".join(lines)


def main() -> None:
    readme = ROOT / "snapshots" / "README.md"
    text = readme.read_text()
    m = re.search(r"The fixture `(v\d+)/compacted/aof/\d+\.aof`", text)
    version = m[1] if m else "v1"
    segment = sorted((ROOT / "snapshots" / version / "compacted" / "aof").glob("*.aof"))[-1]
    text = re.sub(
        r"(The fixture `v\d+/compacted/aof/)\d+(\.aof`, byte for byte:\s*```hex\n)(.*?)```",
        lambda m: m[1] + segment.stem + m[2] + hexdump(segment) + "\n```", text, flags=re.S)
    readme.write_text(text)


if __name__ == "__main__":
    main()
