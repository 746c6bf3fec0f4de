"""Write the sweep report of a set of run folders: ``report.md``, ``report.csv``, ``report.html`` and plots.

A run is named by the keys its sweep varied (``rule.alpha=0.5,optim.lr=0.05``); separate runs by the
overrides whose values differ between them. Neither torch nor matplotlib is imported at the top: the
launcher imports this module at the end of a multirun (:mod:`runner.launcher.callbacks`).
"""

from __future__ import annotations

import csv
from pathlib import Path

from runner.report.runs import NoRuns, load_runs
from runner.report.table import Report, csv_table, markdown, score

__all__ = ["NoRuns", "Report", "write_report"]


def write_report(
    dirs: list[Path], metric: str | None = None, target: float | None = None, out: Path | None = None
) -> Report:
    """Write report.md, report.csv, report.html and the plots for the runs in ``dirs`` into ``out``.

    ``out`` by default: the folder given, if one was; else ``report`` beside the first of them. ``metric``
    None: the runs' ``train.monitor`` (``monitor`` in their summary.json; ``val_acc`` for runs older than it).
    Raises NoRuns (a folder without run folders) or ValueError (a metric no run recorded)."""
    from runner.report.page import page
    from runner.report.plots import write_plots

    runs, keys = load_runs(dirs)
    if metric is None:
        metric = next((run.summary["monitor"] for run in runs if run.summary.get("monitor")), "val_acc")
    recorded = sorted(
        {k for run in runs for r in run.vals for k in r if k.startswith("val_") or "_val_" in k}
    )
    if recorded and metric not in recorded:
        raise ValueError(f"no run recorded {metric!r}; the validations have: {', '.join(recorded)}")
    out = out or (dirs[0] if len(dirs) == 1 else dirs[0].parent / "report")
    out.mkdir(parents=True, exist_ok=True)
    report = score(runs, keys, out, metric, target)
    report.title = ", ".join(str(d) for d in dirs)
    plots = write_plots(report)
    (out / "report.md").write_text(markdown(report, plots))
    header, rows = csv_table(report)
    with open(out / "report.csv", "w", newline="") as file:
        csv.writer(file).writerows([header, *rows])
    (out / "report.html").write_text(page(report, plots))
    return report
