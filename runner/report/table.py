"""The report's table: the runs scored against a metric and a target, as Markdown, CSV and plain rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.report.runs import Run, finite_or_none
from runner.tasks import maximized

#: The default target is this fraction of the best run's best value (divided by it for a loss).
TARGET_FRACTION = 0.95
#: Wall times are not comparable when the runs' load average at their start differs by more than this.
LOAD_SPREAD = 1.0


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

    @property
    def load_note(self) -> str | None:
        """One line when the runs' wall times were taken under different machine loads (the 1-minute load
        average at their start differs by more than :data:`LOAD_SPREAD`, or exceeded the CPUs); else None."""
        return load_note(self.runs)

    def target_text(self) -> str:
        if self.target is None:
            return "none (no run recorded the metric)"
        how = f"{TARGET_FRACTION:.0%} of" if self.maximize else f"1/{TARGET_FRACTION} ×"
        how = f" ({how} the best run's best)" if self.target_default else ""
        return f"{self.metric} {'≥' if self.maximize else '≤'} {self.target:.4g}{how}"


def load_note(runs: list[Run]) -> str | None:
    """:attr:`Report.load_note` of ``runs``, from the load at their start (the end counts their own ranks)."""
    loads = [(r.load.start, r.load.cpus) for r in runs if r.load is not None and r.load.start is not None]
    starts = [start for start, _ in loads]
    spread = len(starts) > 1 and max(starts) - min(starts) > LOAD_SPREAD
    over = sum(1 for start, cpus in loads if cpus and start > cpus)
    if not spread and not over:
        return None
    low, high = min(starts), max(starts)
    span = f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}"
    why = "different machine loads" if spread else "a machine loaded beyond its CPUs"
    more = f", above its CPU count for {_count(over)}" if over else ""
    unknown = f"; unknown for {_count(len(runs) - len(loads))}" if len(loads) < len(runs) else ""
    return (
        f"Wall times were taken under {why} (1-minute load average at the start: {span}{more}{unknown}): "
        "compare steps to target, which the load does not change."
    )


def _count(runs: int) -> str:
    return f"{runs} run{'s' * (runs != 1)}"


def score(
    runs: list[Run], keys: list[str], out: Path, metric: str = "val_acc", target: float | None = None
) -> Report:
    """Score, time and sort ``runs`` on ``metric`` (higher is better for accuracies, lower for losses,
    errors and perplexities; equal bests: fewer steps to target first); a ``target`` of None is
    :data:`TARGET_FRACTION` of the best ok run's best."""
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
        _time_to_target(run, metric, maximize, target)
    sign = -1 if maximize else 1
    runs = sorted(
        runs,
        key=lambda r: (not r.ok, r.best is None, sign * (r.best or 0), *_steps_key(r), sign * (r.final or 0)),
    )
    return Report(runs, keys, metric, maximize, target, default, out, "")


def _time_to_target(run: Run, metric: str, maximize: bool, target: float | None) -> None:
    """Set the time, step and samples at ``run``'s first validation that reached ``target``."""
    run.target_time_s = run.target_step = run.target_samples = None
    for record in run.vals if target is not None else []:
        value = finite_or_none(record.get(metric))
        if value is not None and (value >= target if maximize else value <= target):
            run.target_time_s, run.target_step = finite_or_none(record.get("time")), record.get("step")
            per_step, step = run.samples_per_step, finite_or_none(run.target_step)
            run.target_samples = None if per_step is None or step is None else step * per_step
            return


def _steps_key(run: Run) -> tuple[bool, float]:
    step = finite_or_none(run.target_step)
    return step is None, step or 0.0


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _3(value: float) -> str:
    """Three significant digits, trailing zeros kept (``0.0950``, ``4.79``, ``5.00``); no exponent."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:#.3g}".rstrip(".")


def _samples_shown(report: Report) -> bool:
    return any(r.target_samples is not None for r in report.runs)


def table(report: Report) -> tuple[list[str], list[list[str]]]:
    """The header (units in it) and the cells, as text, of report.md's and report.html's table; samples to
    target only where a run recorded its batch size."""
    m, samples = report.metric, _samples_shown(report)
    header = ["run", "status", f"final {m}", f"best {m}", "time to target (s)", "steps to target"]
    header += ["samples to target"] * samples + ["wall time (s)", "load (start→end)", "samples/s"]
    header += ["comm (% of step)", "sent per worker per step (MB)"]
    cells = []
    for r in report.runs:
        comm = None if r.comm_fraction is None else 100 * r.comm_fraction
        mb = None if r.bytes_per_step is None else r.bytes_per_step / 1e6
        hit = "—" if r.target_time_s is None else _3(r.target_time_s)
        row = [
            r.name,
            r.status,
            _fmt(r.final, ".4f"),
            _fmt(r.best, ".4f"),
            hit,
            _fmt(finite_or_none(r.target_step), ",.0f"),
        ]
        row += [_fmt(r.target_samples, ",.0f")] * samples + [_fmt(r.wall_time_s, ".1f")]
        row += [r.load.text() if r.load else "unknown", _fmt(r.samples_per_s, ",.0f"), _fmt(comm, ".1f")]
        cells.append(row + ["—" if mb is None else _3(mb)])
    return header, cells


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def explanation(report: Report) -> str:
    """The paragraph above the table: how the runs are ranked and what each column measures."""
    order = "highest" if report.maximize else "lowest"
    samples = " (samples: × the global batch, devices × batch_size × accumulate)" * _samples_shown(report)
    return (
        f"{len(report.runs)} runs, ranked by best {report.metric} ({order} first; equal bests: fewer steps "
        f"to target first; runs that did not end ok last). Target: {report.target_text()}. Time to target: "
        "from the start of training to the first validation that reached it (—: not reached); steps to "
        f"target: that validation's optimizer step{samples}. Wall time: the whole job, start-up included. "
        "Times depend on the machine's load (its 1-minute average at the job's start and end; unknown for "
        "runs older than the record), steps do not."
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
        *([f"**{report.load_note}**", ""] if report.load_note else []),
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
    header += ["samples_at_target", "wall_time_s", "load_start", "load_end", "cpus", "samples_per_s"]
    header += ["comm_fraction", "bytes_sent_per_worker", "bytes_sent_per_worker_step", "cause", "dir"]
    rows = []
    for r in report.runs:
        load = [r.load.start, r.load.end, r.load.cpus] if r.load else [None] * 3
        row = [r.name, r.status, *(r.swept.get(k) for k in report.keys), r.final, r.best, r.target_time_s]
        row += [r.target_step, r.target_samples, r.wall_time_s, *load, r.samples_per_s, r.comm_fraction]
        rows.append(row + [r.bytes_per_worker, r.bytes_per_step, r.cause, r.dir])
    return header, [["" if v is None else v for v in row] for row in rows]
