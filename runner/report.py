"""The sweep report: a table and plots comparing the runs of a sweep, or any set of run folders.

    python -m runner.report outputs/multirun/DATE/TIME                  # a sweep: written into its folder
    python -m runner.report outputs/DATE/T1 outputs/DATE/T2 --out cmp   # separate runs, compared in cmp/

Writes ``report.md``, ``report.csv``, ``report.html`` and PNG plots (:mod:`runner.plots`). A run is named by
the keys its sweep varied (``rule.alpha=0.5,optim.lr=0.05``); separate runs by the overrides whose values
differ between them. Neither torch nor matplotlib is imported at the top: the launcher imports this module at
the end of a multirun (:mod:`runner.callbacks`).
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.runs import (
    NoRuns,
    Run,
    finite_or_none,
    load_runs,
)
from runner.tasks import maximized

RAW = argparse.RawDescriptionHelpFormatter
#: The default target is this fraction of the best run's best value (divided by it for a loss).
TARGET_FRACTION = 0.95


@dataclass
class Report:
    """The runs, best first (those that did not end ok last), and what they were compared on."""

    runs: list[Run]
    keys: list[str]
    metric: str
    maximize: bool
    target: float | None
    target_default: bool
    out: Path
    title: str

    @property
    def best(self) -> Run | None:
        return next((r for r in self.runs if r.ok and r.best is not None), None)

    @property
    def failed(self) -> list[Run]:
        return [r for r in self.runs if not r.ok]

    def target_text(self) -> str:
        if self.target is None:
            return "none (no run recorded the metric)"
        how = f"{TARGET_FRACTION:.0%} of" if self.maximize else f"1/{TARGET_FRACTION} ×"
        how = f" ({how} the best run's best)" if self.target_default else ""
        return f"{self.metric} {'≥' if self.maximize else '≤'} {self.target:.4g}{how}"


def score(
    runs: list[Run], keys: list[str], out: Path, metric: str = "val_acc", target: float | None = None
) -> Report:
    """Score, time and sort ``runs`` on ``metric`` (higher is better for accuracies, lower for losses,
    errors and perplexities); a ``target`` of None is :data:`TARGET_FRACTION` of the best ok run's best."""
    maximize = maximized(metric)
    for run in runs:
        values = [v for r in run.vals if (v := finite_or_none(r.get(metric))) is not None]
        if values:
            run.final, run.best = values[-1], (max if maximize else min)(values)
        else:
            run.final = finite_or_none(run.summary.get(f"final_{metric}"))
            run.best = finite_or_none(run.summary.get(f"best_{metric}"))
    default = target is None
    if default:
        scored = [r for r in runs if r.best is not None]
        bests = [r.best for r in scored if r.ok] or [r.best for r in scored]
        if bests:
            target = max(bests) * TARGET_FRACTION if maximize else min(bests) / TARGET_FRACTION
    for run in runs:
        run.target_time_s = run.target_step = None
        for record in run.vals if target is not None else []:
            value = finite_or_none(record.get(metric))
            if value is not None and (value >= target if maximize else value <= target):
                run.target_time_s, run.target_step = finite_or_none(record.get("time")), record.get("step")
                break
    sign = -1 if maximize else 1
    runs = sorted(runs, key=lambda r: (not r.ok, r.best is None, sign * (r.best or 0), sign * (r.final or 0)))
    return Report(runs, keys, metric, maximize, target, default, out, "")


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _3(value: float) -> str:
    """Three significant digits, trailing zeros kept (``0.0950``, ``4.79``, ``5.00``); no exponent."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:#.3g}".rstrip(".")


def table(report: Report) -> tuple[list[str], list[list[str]]]:
    """The header (units in it) and the cells, as text, of report.md's and report.html's table."""
    m = report.metric
    header = ["run", "status", f"final {m}", f"best {m}", "time to target (s)", "wall time (s)"]
    header += ["samples/s", "comm (% of step)", "sent per worker (MB)"]
    cells = []
    for r in report.runs:
        hit = "—" if r.target_time_s is None else f"{_3(r.target_time_s)} (step {r.target_step})"
        comm = None if r.comm_fraction is None else 100 * r.comm_fraction
        mb = None if r.bytes_per_worker is None else _3(r.bytes_per_worker / 1e6)
        cells.append([r.name, r.status, _fmt(r.final, ".4f"), _fmt(r.best, ".4f"), hit])
        cells[-1] += [_fmt(r.wall_time_s, ".1f"), _fmt(r.samples_per_s, ",.0f"), _fmt(comm, ".1f"), mb or "—"]
    return header, cells


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def explanation(report: Report) -> str:
    order = "highest" if report.maximize else "lowest"
    return (
        f"{len(report.runs)} runs, sorted by best {report.metric} ({order} first; runs that did not end ok "
        f"last). Target: {report.target_text()}. Time to target: from the start of training to the first "
        "validation that reached it. Wall time: the whole job, start-up included."
    )


def markdown(report: Report, plots: list[Path]) -> str:
    header, cells = table(report)
    best = report.best
    lines = [f"# Report: {report.title}", ""]
    if best is not None:
        lines.append(f"**Best run: {best.name}** ({report.metric} {best.best:.4f}, `{best.dir}`)")
    else:
        lines.append("**No run ended ok with a recorded metric.**")
    lines += [
        "",
        explanation(report),
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" if i < 2 else "---:" for i in range(len(header))) + " |",
        *("| " + " | ".join(_md(c) for c in row) + " |" for row in cells),
    ]
    if report.failed:
        lines += ["", "## Runs that did not end ok", ""]
        lines += [f"- **{r.name}** ({r.status}, `{r.dir}`): {_md(r.cause or '')}" for r in report.failed]
    if plots:
        lines += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots)]
    return "\n".join(lines) + "\n"


def csv_table(report: Report) -> tuple[list[str], list[list[Any]]]:
    """report.csv: raw numbers (seconds, fractions, bytes; units in the header), a column per swept key."""
    m = report.metric
    header = ["run", "status", *report.keys, f"final_{m}", f"best_{m}", "time_to_target_s", "step_at_target"]
    header += ["wall_time_s", "samples_per_s", "comm_fraction", "bytes_sent_per_worker", "cause", "dir"]
    rows = [
        [r.name, r.status, *(r.swept.get(k) for k in report.keys), r.final, r.best, r.target_time_s]
        + [r.target_step, r.wall_time_s, r.samples_per_s, r.comm_fraction, r.bytes_per_worker, r.cause, r.dir]
        for r in report.runs
    ]
    return header, [["" if v is None else v for v in row] for row in rows]


def write_report(
    dirs: list[Path], metric: str | None = None, target: float | None = None, out: Path | None = None
) -> Report:
    """Write report.md, report.csv, report.html and the plots for the runs in ``dirs`` into ``out``: by
    default the folder given, if one was; else ``report`` beside the first of them. ``metric`` None: the
    runs' ``train.monitor`` (``monitor`` in their summary.json; ``val_acc`` for runs older than it). Raises
    NoRuns (a folder without run folders) or ValueError (a metric no run recorded)."""
    from runner.plots import page, write_plots

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python -m runner.report", description=__doc__, formatter_class=RAW)
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="a sweep folder, or run folders")
    parser.add_argument(
        "--metric",
        default=None,
        help="validation metric (default: the runs' train.monitor; *_acc: higher is better)",
    )
    parser.add_argument("--target", type=float, help="time to target's target (default: 95%% of the best)")
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
    best = report.best
    print(f"{len(report.runs)} runs; best: {best.name if best else 'none'}; target: {report.target_text()}")
    print(f"wrote {report.out / 'report.html'} (and report.md, report.csv and the PNGs beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
