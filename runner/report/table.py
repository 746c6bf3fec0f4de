"""The report's table: the runs scored against a metric and a target, as Markdown, CSV and plain rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.report import network, verdict
from runner.report.confidence import Point, Standing, other_name
from runner.report.runs import Run, finite_or_none
from runner.tasks import maximized

#: The default target is this fraction of the best run's best value (divided by it for a loss).
TARGET_FRACTION = 0.95
#: Wall times are not comparable when the runs' load average at their start differs by more than this.
LOAD_SPREAD = 1.0
#: The metric shown beside the scored one, by its ending: a loss's perplexity (its exp), and the reverse.
BESIDE = {"loss": "ppl", "ppl": "loss"}


@dataclass
class Report:
    """The runs, best first (those that did not end ok last), what they were compared on, and their standing.

    The standing: the points they make (runs that differ only in their seed) ranked in groups of ties;
    ``beside``: the metric shown beside the scored one (None: no run recorded it)."""

    runs: list[Run]
    keys: list[str]
    metric: str
    maximize: bool
    target: float | None
    target_default: bool
    out: Path
    title: str
    standing: Standing
    beside: str | None = None

    @property
    def points(self) -> list[Point]:
        return self.standing.points

    @property
    def repeated(self) -> bool:
        return self.standing.repeated

    @property
    def others(self) -> list[str]:
        """The record prefixes of the rules' other validated models some run recorded (``worker_mean``)."""
        return list(dict.fromkeys(k for r in self.runs for k in r.others))

    @property
    def best(self) -> Run | None:
        return next((r for r in self.runs if r.ok and r.best is not None), None)

    @property
    def failed(self) -> list[Run]:
        return [r for r in self.runs if not r.ok]

    @property
    def load_note(self) -> str | None:
        """One line when the runs' wall times were taken under different machine loads; else None.

        Different: the 1-minute load average at their start differs by more than :data:`LOAD_SPREAD`, or
        exceeded the CPUs."""
        return load_note(self.runs)

    def target_text(self) -> str:
        if self.target is None:
            return "none (no run recorded the metric)"
        best = f"the best run's best, {self.target * TARGET_FRACTION:.4g}, ÷ {TARGET_FRACTION}"
        how = f"{TARGET_FRACTION:.0%} of the best run's best" if self.maximize else best
        how = f" ({how})" if self.target_default else ""
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
    """Score, time and sort ``runs`` on ``metric``.

    Higher is better for accuracies, lower for losses, errors and perplexities; equal bests: fewer steps to
    target first. A ``target`` of None is :data:`TARGET_FRACTION` of the best ok run's best (the best divided
    by it, where lower is better)."""
    maximize, beside = maximized(metric), beside_metric(metric)
    for run in runs:
        run.final, run.best = final_best(run, metric)
        run.beside = final_best(run, beside) if beside else (None, None)
        run.others = _others(run, metric, maximize)
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
    standing = Standing.of(runs, metric, maximize)
    beside = beside if any(v is not None for r in runs for v in r.beside) else None
    return Report(runs, keys, metric, maximize, target, default, out, "", standing, beside)


def beside_metric(metric: str) -> str | None:
    """The metric shown beside ``metric`` (``val_ppl`` beside ``val_loss``), None where there is none."""
    head, _, end = metric.rpartition("_")
    return f"{head}_{BESIDE[end]}" if head and end in BESIDE else None


def final_best(run: Run, metric: str) -> tuple[float | None, float | None]:
    """``run``'s last and best ``metric``.

    Best: the highest or lowest, by :func:`runner.tasks.maximized`. From its validations, else its
    summary.json's ``final_``/``best_`` values."""
    values = [v for r in run.vals if (v := finite_or_none(r.get(metric))) is not None]
    if values:
        return values[-1], (max if maximized(metric) else min)(values)
    summary = run.summary
    return finite_or_none(summary.get(f"final_{metric}")), finite_or_none(summary.get(f"best_{metric}"))


def _others(run: Run, metric: str, maximize: bool) -> dict[str, float]:
    """The best ``metric`` of each other model ``run`` validated (``<prefix>_<metric>`` in its records)."""
    best: dict[str, float] = {}
    for record in run.vals:
        for key, value in record.items():
            number = finite_or_none(value)
            if key.endswith(f"_{metric}") and number is not None:
                prefix = key.removesuffix(f"_{metric}")
                held = best.get(prefix, number)
                best[prefix] = max(held, number) if maximize else min(held, number)
    return best


def _time_to_target(run: Run, metric: str, maximize: bool, target: float | None) -> None:
    """Set the time, step, samples and tokens at ``run``'s first validation that reached ``target``.

    Reached: at or above it where higher is better, at or below it for a loss."""
    run.target_time_s = run.target_step = run.target_samples = run.target_tokens = None
    for record in run.vals if target is not None else []:
        value = finite_or_none(record.get(metric))
        if value is not None and (value >= target if maximize else value <= target):
            run.target_time_s, run.target_step = finite_or_none(record.get("time")), record.get("step")
            per_step, step = run.samples_per_step, finite_or_none(run.target_step)
            run.target_samples = None if per_step is None or step is None else step * per_step
            tokens = run.tokens_per_sample
            run.target_tokens = (
                None if run.target_samples is None or tokens is None else run.target_samples * tokens
            )
            return


def _steps_key(run: Run) -> tuple[bool, float]:
    step = finite_or_none(run.target_step)
    return step is None, step or 0.0


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _3(value: float) -> str:
    """Three significant digits, trailing zeros kept (``0.0950``, ``4.79``, ``5.00``); no exponent."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:#.3g}".rstrip(".")


def _counts(report: Report) -> tuple[bool, bool]:
    """Whether the table counts samples (a run that counts no tokens) and tokens (one that does)."""
    tokens = [r.tokens_per_s is not None for r in report.runs]
    return not all(tokens), any(tokens)


def _samples_shown(report: Report) -> bool:
    return _counts(report)[0] and any(r.target_samples is not None for r in report.runs)


def _shown(report: Report) -> tuple[bool, bool]:
    """Whether the table shows samples to target and tokens to target."""
    return _samples_shown(report), _counts(report)[1]


def table(report: Report) -> tuple[list[str], list[list[str]]]:
    """The header (units in it) and the cells, as text, of report.md's and report.html's table.

    Samples to target only where a run recorded its batch size; tokens instead where every run counts them (a
    language model), beside samples where some do."""
    m, b, samples, others = report.metric, report.beside, _samples_shown(report), report.others
    per_s, tokens = _counts(report)
    header = ["run", "status", f"final {m}", f"best {m}", *(f"{w} {b}" for w in ("final", "best") if b)]
    header += [*(f"best {m}: {other_name(k)}" for k in others), "time to target (s)", "steps to target"]
    header += ["samples to target"] * samples + ["tokens to target"] * tokens
    header += ["wall time (s)", "load (start→end)"] + ["samples/s"] * per_s + ["tokens/s"] * tokens
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
            *(_fmt(v, ".4f") for v in r.beside if b),
            *(_fmt(r.others.get(k), ".4f") for k in others),
            hit,
            _fmt(finite_or_none(r.target_step), ",.0f"),
        ]
        row += [_fmt(r.target_samples, ",.0f")] * samples + [_fmt(r.target_tokens, ",.0f")] * tokens
        row += [_fmt(r.wall_time_s, ".1f"), r.load.text() if r.load else "unknown"]
        row += [_fmt(r.samples_per_s, ",.0f")] * per_s + [_fmt(r.tokens_per_s, ",.0f")] * tokens
        cells.append(row + [_fmt(comm, ".1f"), "—" if mb is None else _3(mb)])
    return header, cells


def _per_step(report: Report) -> str:
    """How the table turns steps to target into samples and tokens (empty: it shows neither)."""
    (samples, tokens), batch = _shown(report), "the global batch, devices × batch_size × accumulate"
    parts = [f"samples: × {batch}"] * samples
    of = "the samples" if samples else batch
    parts += [f"tokens: × {of} × the tokens of a sample, data.shape[-1] in its config.yaml"] * tokens
    return f" ({'; '.join(parts)})" if parts else ""


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def explanation(report: Report) -> str:
    """The paragraph above the table: how the runs are ranked and what each column measures."""
    order, b = ("highest" if report.maximize else "lowest"), report.beside
    beside = f" {b} beside it, not ranked (best: its {'highest' if maximized(b) else 'lowest'})." if b else ""
    return (
        f"{len(report.runs)} runs, ranked by best {report.metric} ({order} first; equal bests: fewer steps "
        f"to target first; runs that did not end ok last).{beside} Target: {report.target_text()}. Time to "
        "target: from the start of training to the first validation that reached it (—: not reached); steps "
        f"to target: that validation's optimizer step{_per_step(report)}. Wall time: the whole job, start-up "
        "included. Times depend on the machine's load (its 1-minute average at the job's start and end; "
        "unknown for runs older than the record), steps do not."
    )


def headlines(report: Report) -> list[tuple[str, str]]:
    """The report's first line, answering what the sweep varied.

    Over link speeds, the first to the target at each (:func:`runner.report.network.headline`), then the best
    by the metric; else the best alone."""
    best = verdict.headline(report.standing)
    if (cross := network.crossover(report)) is None:
        return [best]
    return [network.headline(cross), (f"By best {report.metric}: {best[0][0].lower()}{best[0][1:]}", best[1])]


def verdict_line(report: Report) -> str:
    """The console's line on what won: per link speed for a sweep over them, else the best run or point."""
    cross = network.crossover(report)
    return network.summary_line(cross) if cross is not None else f"best: {verdict.verdict(report.standing)}"


def markdown(report: Report, plots: list[Path]) -> str:
    """report.md: the verdict and how sure it is, the points, the runs' table, the plots.

    The points only when seeds were repeated; the runs that did not end ok follow the runs' table."""
    header, cells = table(report)
    lines = [f"# Report: {report.title}", ""]
    lines += [" ".join(f"**{_md(b)}** {_md(n)}".rstrip() for b, n in headlines(report)[:1]), ""]
    lines += [f"{_md(b)} {_md(n)}".rstrip() + "\n" for b, n in headlines(report)[1:]]
    lines += [line for text in verdict.paragraphs(report.standing) for line in (_md(text), "")]
    if (cross := network.crossover(report)) is not None:
        lines += [f"## {network.heading(cross)}", "", *(f"- {_md(t)}" for t in network.section(cross)), ""]
        lines += [f"**{report.load_note}**", ""] if report.load_note else []
        lines += [_md(network.explanation(cross)), "", *_md_table(*network.grid(cross), 1), ""]
    if report.repeated:
        points_header, points_cells = verdict.points_table(report.standing)
        lines += ["## Points (mean over seeds)", "", *_md_table(points_header, points_cells, 1), ""]
    if report.repeated or cross is not None:
        lines += ["## Runs", ""]
    lines += [
        explanation(report),
        "",
        *([f"**{report.load_note}**", ""] if report.load_note else []),
        *_md_table(header, cells, 2),
    ]
    if report.failed:
        lines += ["", "## Runs that did not end ok", ""]
        lines += [f"- **{r.name}** ({r.status}, `{r.dir}`): {_md(r.cause or '')}" for r in report.failed]
    if plots:
        lines += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots)]
    return "\n".join(lines) + "\n"


def _md_table(header: list[str], cells: list[list[str]], text_columns: int) -> list[str]:
    """A Markdown table: its first ``text_columns`` aligned left, the numbers right."""
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" if i < text_columns else "---:" for i in range(len(header))) + " |",
        *("| " + " | ".join(_md(c) for c in row) + " |" for row in cells),
    ]


def csv_table(report: Report) -> tuple[list[str], list[list[Any]]]:
    """report.csv: raw numbers (seconds, fractions, bytes; units in the header), a column per swept key.

    ``point``: the run's point (its name without the seed); ``val_count``: the items a validation counts;
    where a run counts tokens, ``tokens_at_target``, ``tokens_per_s`` and ``tokens`` (trained on, all
    workers)."""
    m, b, others, tokens = report.metric, report.beside, report.others, _counts(report)[1]
    point = {id(r): p.name for p in report.points for r in p.runs}
    header = ["run", "point", "status", *report.keys, f"final_{m}", f"best_{m}"]
    header += [*(f"{w}_{b}" for w in ("final", "best") if b), *(f"best_{k}_{m}" for k in others)]
    header += ["val_count", "time_to_target_s", "step_at_target", "samples_at_target"]
    header += ["tokens_at_target"] * tokens + ["wall_time_s", "load_start", "load_end", "cpus"]
    header += ["samples_per_s", *["tokens_per_s", "tokens"] * tokens, "comm_fraction"]
    header += ["bytes_sent_per_worker", "bytes_sent_per_worker_step", "cause", "dir"]
    rows = []
    for r in report.runs:
        load = [r.load.start, r.load.end, r.load.cpus] if r.load else [None] * 3
        row = [r.name, point[id(r)], r.status, *(r.swept.get(k) for k in report.keys), r.final, r.best]
        row += [*(r.beside if b else ()), *(r.others.get(k) for k in others), r.summary.get("val_count")]
        row += [r.target_time_s, r.target_step, r.target_samples, *[r.target_tokens] * tokens]
        row += [r.wall_time_s, *load, r.samples_per_s]
        row += [r.tokens_per_s, finite_or_none(r.summary.get("tokens"))] * tokens + [r.comm_fraction]
        rows.append(row + [r.bytes_per_worker, r.bytes_per_step, r.cause, r.dir])
    return header, [["" if v is None else v for v in row] for row in rows]
