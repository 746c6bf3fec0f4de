"""The report's table: the runs scored against a metric and a target, as Markdown, CSV and plain rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.report.runs import Run, finite_or_none
from runner.tasks import maximized

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
