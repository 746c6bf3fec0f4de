"""The sweep report's command: a table and plots comparing the runs of a sweep, or any set of run folders.

    python -m runner.report outputs/multirun/DATE/TIME                  # a sweep: written into its folder
    python -m runner.report outputs/DATE/T1 outputs/DATE/T2 --out cmp   # separate runs, compared in cmp/

Writes ``report.md``, ``report.csv``, ``report.html`` and PNG plots (:mod:`runner.report.plots`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.report.runs import NoRuns
from runner.report.table import verdict_line
from runner.report.write import write_report

RAW = argparse.RawDescriptionHelpFormatter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python -m runner.report", description=__doc__, formatter_class=RAW)
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="a sweep folder, or run folders")
    parser.add_argument(
        "--metric",
        default=None,
        help="validation metric (default: the runs' train.monitor; *_acc: higher is better)",
    )
    parser.add_argument(
        "--target",
        type=float,
        help="time to target's target: the first validation at or above it, at or below it for a loss "
        "(default: 95%% of the best run's best; for a loss, the best / 0.95)",
    )
    parser.add_argument("--out", type=Path, help="output folder (default: the one DIR, else DIR/../report)")
    args = parser.parse_args(argv)
    missing = [d for d in args.dirs if not d.is_dir()]
    try:
        if missing:
            raise NoRuns(f"{missing[0]}: no such folder")
        report = write_report(args.dirs, args.metric, args.target, args.out)
    except (NoRuns, ValueError) as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    print(f"{len(report.runs)} runs; {verdict_line(report)}; target: {report.target_text()}")
    print(f"wrote {report.out / 'report.html'} (and report.md, report.csv and the PNGs beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
