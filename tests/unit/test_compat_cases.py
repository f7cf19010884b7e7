"""The compatibility cases themselves (run against both servers by tests/procs/test_compat_bytes.py).
"""

from __future__ import annotations

from ..support.compat_cases import CASES


def test_case_names_unique() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
