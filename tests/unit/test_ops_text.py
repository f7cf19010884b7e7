"""The operator tools' shared formatting: durations, sizes, body previews, clock times.
"""

from __future__ import annotations

from smallstalk.ops import text as fmt


def test_formats() -> None:
    assert [fmt.fmt_dur(n) for n in (0, 999, 42_000_000, 1_234_000_000, 12_340_000_000,
                                       185 * 10**9, 7500 * 10**9,
                                       (3 * 86400 + 4 * 3600) * 10**9, -2 * 10**9)] == [
        "0s", "<1ms", "42ms", "1.23s", "12.3s", "3m05s", "2h05m", "3d04h", "-2.00s"]
    assert [fmt.fmt_size(n) for n in (0, 1023, 1536, 5 << 20, 3 << 40, -2048, None)] == [
        "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 TiB", "-2.0 KiB", "-"]
    assert fmt.preview(b'a"b\\\r\n\x00\xff' + b"z" * 30) == (
        '38 B "a\\"b\\\\\\r\\n\\x00\\xffzzzzzzzzzzzzzzzz..."')
    ns = 1_795_250_816_410_328_385
    utc, local = fmt.Clock(utc=True), fmt.Clock(utc=False)
    assert utc.fmt(ns) == "2026-11-21 08:46:56.410Z"
    assert utc.parse("2026-11-21 08:46:56.410") == utc.parse("2026-11-21T08:46:56.41Z") \
        == ns // 10**6 * 10**6
    assert local.parse(local.fmt(ns)) == ns // 10**6 * 10**6  # local times carry their offset
    assert len(local.fmt(ns)) == local.width and len(utc.fmt(ns)) == utc.width
