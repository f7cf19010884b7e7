"""Job analytics from the AOF on Spark (`smallstalk analyze`; the `analytics` extra).

- `source`: the `smallstalk` PySpark data source, segments and snapshots as a
  DataFrame of records, decoded in parallel with the project's own readers;
- `pipeline`: job lifecycles, reservation attempts, per-tube and per-window
  metrics, written as Parquet;
- `report`: the printed summary table and the HTML report with SVG charts;
- `command`: the command line (`main`), local mode or spark-submit;
- `gen`: synthetic valid data directories for sizing
  (`python -m smallstalk.analytics.gen`).

Importing this package does not import PySpark; `main` does, when it runs.
See docs/ANALYTICS.md.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """`smallstalk analyze ARGS`; returns the exit status."""
    from .command import main as command_main

    return command_main(argv)


__all__ = ["main"]
