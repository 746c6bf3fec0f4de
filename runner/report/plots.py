"""The report's plots (PNG, matplotlib's Agg canvas; no pyplot, no display).

The HTML page that shows them is :mod:`runner.report.page`.

matplotlib is imported inside the functions: :mod:`runner.report.write` is imported by the launcher at the end
of a multirun, and a launch that writes no report should not pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.report import network
from runner.report.confidence import REPEAT_KEYS
from runner.report.crossover_plot import crossover_figure
from runner.report.figure import figure, log_scale, palette
from runner.report.runs import finite_or_none
from runner.report.table import Report

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from runner.report.runs import Run

#: The report's plots, in the order shown.
PLOTS = (
    "curves",
    "crossover",
    "heatmap",
    "scatter",
    "time_to_target",
    "bytes_per_worker",
    "rule_metrics",
    "workers",
)
#: Per-epoch metrics of the rules, plotted over steps when a run recorded them: key -> (title, y label).
RULE_METRICS = {
    "center_distance": ("EASGD: distance of the workers to the center", "RMS distance to the center"),
    "spread": ("GoSGD: spread of the workers around the consensus", "weighted RMS distance to the consensus"),
}
TITLES = {
    "val_acc": "Validation accuracy",
    "val_loss": "Validation loss",
    "worker_mean_val_acc": "Validation accuracy of the workers' mean model",
    "worker_mean_val_loss": "Validation loss of the workers' mean model",
}
LABELS = {
    "val_acc": "validation accuracy (fraction correct)",
    "val_loss": "validation loss (cross-entropy)",
    "worker_mean_val_acc": "validation accuracy of the workers' mean model (fraction)",
    "worker_mean_val_loss": "validation loss of the workers' mean model (cross-entropy)",
}


def metric_label(metric: str) -> str:
    return LABELS.get(metric, metric)


@dataclass
class Grid:
    """A 2-key sweep's best metric per cell.

    ``values[i][j]`` for ``rows[i]`` of ``row_key`` and ``cols[j]`` of ``col_key`` (None: no run, or no
    value); ``status`` the cell's run's status."""

    row_key: str
    col_key: str
    rows: list[Any]
    cols: list[Any]
    values: list[list[float | None]]
    status: list[list[str | None]]


def _order(value: Any) -> tuple:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (not number, value if number else str(value))


def heatmap_grid(report: Report) -> Grid | None:
    """The grid of a report over exactly two swept keys besides the seed (None otherwise).

    A cell is a point, its mean best over its seeds (a point without an ok run: its first run's best and
    status); a cell with several points keeps the best of them."""
    keys = [k for k in report.keys if k not in REPEAT_KEYS]
    if len(keys) != 2:
        return None
    rk, ck = keys
    cells = [(p, p.runs[0]) for p in report.points if rk in p.runs[0].swept and ck in p.runs[0].swept]
    rows = sorted({run.swept[rk] for _, run in cells}, key=_order)
    cols = sorted({run.swept[ck] for _, run in cells}, key=_order)
    values: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    status: list[list[str | None]] = [[None] * len(cols) for _ in rows]
    for point, run in cells:  # best first: the first point of a cell is its best
        i, j = rows.index(run.swept[rk]), cols.index(run.swept[ck])
        if status[i][j] is None:
            best = run.best if point.best is None else point.best.mean
            values[i][j], status[i][j] = best, "ok" if point.ok else run.status
    return Grid(rk, ck, rows, cols, values, status)


#: The most characters of a run's name a plot shows (legends and bar labels): a longer one (runs of separate
#: folders, named by every key that differs) keeps its start and end around an ellipsis, so it cannot crush
#: the plot; the tables and report.csv keep the whole name.
LABEL_CHARS = 48


def _tag(run: Run) -> str:
    """A run's label in a plot: its name, shortened to :data:`LABEL_CHARS`, and its status if not ok."""
    name = run.name
    if len(name) > LABEL_CHARS:
        keep = (LABEL_CHARS - 1) // 2
        name = f"{name[:keep]}…{name[-(LABEL_CHARS - 1 - keep) :]}"
    return name if run.ok else f"{name} ({run.status})"


def _legend(fig: Figure, axes: Axes, count: int) -> None:
    handles, labels = axes.get_legend_handles_labels()
    if handles:
        columns = 1 if count <= 4 else 2 if count <= 12 else 3
        fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize=9, frameon=False)


def _curves(report: Report, colors: dict[str, Any]) -> Figure | None:
    m = report.metric
    series = [(run, [r for r in run.vals if isinstance(r.get(m), (int, float))]) for run in report.runs]
    series = [(run, vals) for run, vals in series if vals]
    if not series:
        return None
    fig = figure(13, 5.2 + 0.22 * ((len(series) + 1) // (1 if len(series) <= 4 else 2)))
    left, right = fig.subplots(1, 2, sharey=True)
    for run, vals in series:
        style = {
            "color": colors[run.name],
            "marker": "o",
            "markersize": 4,
            "linestyle": "-" if run.ok else "--",
        }
        left.plot([r.get("time") for r in vals], [r[m] for r in vals], label=_tag(run), **style)
        right.plot([r.get("step") for r in vals], [r[m] for r in vals], **style)
    for axes, xlabel in ((left, "wall time since training started (s)"), (right, "training steps")):
        if report.target is not None:
            axes.axhline(report.target, color="grey", linestyle=":", linewidth=1.2)
        axes.set_xlabel(xlabel)
        axes.grid(alpha=0.3)
    if report.target is not None:
        left.plot([], [], color="grey", linestyle=":", label=f"target {report.target:.4g}")
    _log_y(left, [r[m] for _, vals in series for r in vals], metric_label(m))
    left.set_title(f"{m} against wall time")
    right.set_title(f"{m} against steps")
    fig.suptitle(f"{TITLES.get(m, m)} ({m}) of each run", fontsize=13)
    _legend(fig, left, len(series) + 1)
    return fig


def _tick(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _heatmap(report: Report) -> tuple[str, Figure] | None:
    """A heatmap of the grid, or a scatter of the runs for a sparse one.

    Sparse: most cells without a run (Optuna's samples of continuous ranges). The scatter puts the runs over
    the two keys, coloured by the metric."""
    grid = heatmap_grid(report)
    if grid is None or all(v is None for row in grid.values for v in row):
        return None
    import numpy as np

    data = np.array([[np.nan if v is None else v for v in row] for row in grid.values], dtype=float)
    low, high = np.nanmin(data), np.nanmax(data)
    norm = "log" if log_scale(list(data.flat)) else "linear"
    filled = sum(s is not None for row in grid.status for s in row)
    sparse = 2 * filled < len(grid.rows) * len(grid.cols) and _numeric(grid.rows + grid.cols)
    fig = figure(7.5, 5.5) if sparse else figure(max(5.5, 1.4 * len(grid.cols) + 3), len(grid.rows) + 2)
    axes = fig.subplots()
    cells = [(i, j, v) for i, row in enumerate(grid.values) for j, v in enumerate(row)]
    if sparse:
        points = [(grid.cols[j], grid.rows[i], v) for i, j, v in cells if v is not None]
        xs, ys, vs = zip(*points, strict=True)
        image = axes.scatter(xs, ys, c=vs, cmap="viridis", norm=norm, s=120, edgecolors="black")
        for x, y, v in points:
            axes.annotate(f"{v:.4f}", (x, y), xytext=(0, 9), textcoords="offset points", ha="center")
        axes.grid(alpha=0.3)
    else:
        image = axes.imshow(data, cmap="viridis", norm=norm, origin="lower", aspect="auto")
        for i, j, value in cells:
            status = grid.status[i][j]
            text = "no run" if status is None else "—" if value is None else f"{value:.4f}"
            text += f"\n({status})" if status not in (None, "ok") else ""
            shown = value is not None and high > low and (value > 0 or norm == "linear")
            dark = shown and image.norm(value) < 0.6
            axes.text(j, i, text, ha="center", va="center", color="white" if dark else "black", fontsize=11)
        axes.set_xticks(range(len(grid.cols)), [_tick(c) for c in grid.cols])
        axes.set_yticks(range(len(grid.rows)), [_tick(r) for r in grid.rows])
    axes.set(xlabel=grid.col_key, ylabel=grid.row_key)
    fig.colorbar(image, ax=axes, label=f"best {report.metric}" + (" (log scale)" if norm == "log" else ""))
    seeds = " (mean over seeds)" * report.repeated
    axes.set_title(f"Best {report.metric}{seeds} over {grid.row_key} × {grid.col_key}")
    return ("scatter" if sparse else "heatmap"), fig


@dataclass
class Panel:
    """One panel of a bar chart: a value per run (None: none; drawn empty), its note and the axis label."""

    values: list[float | None]
    notes: list[str]
    xlabel: str
    title: str = ""


def _bars(report: Report, colors: dict[str, Any], panels: list[Panel], title: str) -> Figure:
    """Horizontal bars, a row per run and a panel (sharing the rows) per :class:`Panel`.

    A log axis where the values span orders of magnitude."""
    runs = report.runs
    fig = figure(10 if len(panels) == 1 else 13, 1.6 + 0.45 * len(runs))
    ys = list(range(len(runs)))[::-1]
    for axes, panel in zip(fig.subplots(1, len(panels), sharey=True, squeeze=False)[0], panels, strict=True):
        known = [v for v in panel.values if v is not None and v > 0]
        log = log_scale(known)
        low = min(known) / 2 if log else 0.0
        shown = [low if v is None or v <= 0 else v for v in panel.values]
        widths = [v - low for v in shown]
        bars = axes.barh(ys, widths, left=low, color=[colors[r.name] for r in runs], height=0.6)
        for bar, run, note, x in zip(bars, runs, panel.notes, shown, strict=True):
            if not run.ok:
                bar.set_hatch("//")
            y = bar.get_y() + bar.get_height() / 2
            axes.annotate(note, (x, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=9)
        if log:
            axes.set_xscale("log")
        axes.set_xlim(low, max(known + [1e-9]) * (4 if log else 1.18))
        axes.set_xlabel(panel.xlabel + (" (log scale)" if log else ""))
        axes.grid(axis="x", alpha=0.3)
        axes.set_title(panel.title)
    fig.axes[0].set_yticks(ys, [_tag(r) for r in runs])
    fig.suptitle(title, fontsize=13)
    return fig


def _time_to_target(report: Report, colors: dict[str, Any]) -> Figure | None:
    """Bars of each run's time and steps to the target (the time's panel says when loads differed)."""
    runs = report.runs
    if len(runs) < 2 or report.target is None:
        return None
    loaded = report.load_note is not None
    times = [
        "not reached" if r.target_time_s is None else f"{r.target_time_s:.3g} s" + _load_tag(r, loaded)
        for r in runs
    ]
    steps = ["not reached" if r.target_step is None else f"step {r.target_step}" for r in runs]
    when = "wall time, under different machine loads: compare steps" if loaded else "wall time"
    panels = [
        Panel([r.target_time_s for r in runs], times, "wall time from the start of training (s)", when),
        Panel([finite_or_none(r.target_step) for r in runs], steps, "optimizer steps", "training steps"),
    ]
    return _bars(report, colors, panels, f"Time and steps to {report.target_text()}")


def _load_tag(run: Run, loaded: bool) -> str:
    if not loaded:
        return ""
    start = None if run.load is None else run.load.start
    return " (load unknown)" if start is None else f" (load {start:.1f})"


def _bytes_per_step(report: Report, colors: dict[str, Any]) -> Figure | None:
    """Bars of the bytes each worker sent per optimizer step; None unless at least two runs differ in it.

    The rules' communication, whatever the runs' lengths."""
    mbs = [None if r.bytes_per_step is None else r.bytes_per_step / 1e6 for r in report.runs]
    if len({f"{v:.3g}" for v in mbs if v is not None}) < 2:
        return None
    notes = ["not recorded" if v is None else f"{v:.3g} MB" for v in mbs]
    xlabel = "megabytes sent per worker per optimizer step (MB, 10⁶ bytes)"
    panel = Panel(mbs, notes, xlabel)
    return _bars(
        report, colors, [panel], "Bytes sent per worker per training step (each rule's communication)"
    )


def _rule_metrics(report: Report, colors: dict[str, Any]) -> Figure | None:
    """EASGD's and GoSGD's per-epoch metrics over steps, a panel each.

    A log axis where they span orders of magnitude (a run that drifted away next to healthy ones)."""
    present = [k for k in RULE_METRICS if any(k in r for run in report.runs for r in run.kind("epoch"))]
    if not present:
        return None
    fig = figure(7 * len(present), 5.2)
    for axes, key in zip(fig.subplots(1, len(present), squeeze=False)[0], present, strict=True):
        series = [(run, _points(run, key)) for run in report.runs]
        for run, points in series:
            if points:
                steps, values = zip(*points, strict=True)
                axes.plot(
                    steps,
                    values,
                    marker="o",
                    markersize=4,
                    color=colors[run.name],
                    label=_tag(run),
                    linestyle="-" if run.ok else "--",
                )
        title, ylabel = RULE_METRICS[key]
        _log_y(axes, [v for _, points in series for _, v in points], f"{ylabel} ({key})")
        axes.set(title=title, xlabel="training steps")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    return fig


def worker_counts(run: Run) -> list[tuple[int, int]]:
    """``(step, workers)`` from the run's start through each loss and join (fault tolerance, elastic workers).

    Empty for a run whose workers never changed."""
    changes = [r for r in run.records if r.get("kind") in ("failure", "joined") and "workers" in r]
    start = run.summary.get("devices") or (changes[0]["workers"] if changes else None)
    if not changes or start is None:
        return []
    return [(0, int(start)), *((int(r["step"]), int(r["workers"])) for r in changes)]


def _workers(report: Report, colors: dict[str, Any]) -> Figure | None:
    """The number of workers over steps, for the runs that lost workers or grew; None when none did."""
    series = [(run, worker_counts(run)) for run in report.runs]
    if not any(points for _, points in series):
        return None
    fig = figure(7, 4.2)
    axes = fig.subplots()
    for run, points in series:
        if points:
            end = run.summary.get("steps") or points[-1][0]
            steps, counts = zip(*points, (end, points[-1][1]), strict=True)
            axes.step(steps, counts, where="post", color=colors[run.name], label=_tag(run), marker="o")
    axes.set(title="Workers over the run (losses and joins)", xlabel="training steps", ylabel="workers")
    axes.yaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return fig


def _points(run: Run, key: str) -> list[tuple[Any, float]]:
    """``(step, value)`` of each of ``run``'s epoch records with a finite ``key``."""
    return [(r.get("step"), v) for r in run.kind("epoch") if (v := finite_or_none(r.get(key))) is not None]


def _log_y(axes: Axes, values: list[float], ylabel: str) -> None:
    """Label the y axis, logarithmic (and said so) where ``values`` span orders of magnitude."""
    log = log_scale(values)
    if log:
        axes.set_yscale("log")
    axes.set_ylabel(ylabel + (" (log scale)" if log else ""))


def figures(report: Report) -> dict[str, Figure | None]:
    """The report's figures by name (of :data:`PLOTS`; None: nothing to draw).

    Bars need two runs (and bytes per step two that differ in it); the heatmap a sweep over exactly two keys;
    rule metrics a run that recorded them; the crossover a sweep over link speeds
    (:mod:`runner.report.network`)."""
    runs = report.runs
    colors = dict(zip((r.name for r in runs), palette(len(runs)), strict=True))
    drawn: dict[str, Figure | None] = {"curves": _curves(report, colors)}
    cross = network.crossover(report)
    axis = cross is not None and any(isinstance(g, (float, network.Latency)) for g in cross.speeds)
    drawn["crossover"] = crossover_figure(cross) if axis else None  # (kinds of network: no axis)
    if (grid := _heatmap(report)) is not None:
        drawn[grid[0]] = grid[1]
    drawn["time_to_target"] = _time_to_target(report, colors)
    drawn["bytes_per_worker"] = _bytes_per_step(report, colors)
    drawn["rule_metrics"] = _rule_metrics(report, colors)
    drawn["workers"] = _workers(report, colors)
    return drawn


def write_plots(report: Report) -> list[Path]:
    """Write the report's PNGs (:func:`figures`) into ``report.out``.

    Those of :data:`PLOTS` an earlier report left there that this one has not are removed. Returns those
    written, in the order to show them."""
    drawn = figures(report)
    written = []
    for name in PLOTS:
        path, fig = report.out / f"{name}.png", drawn.get(name)
        if fig is None:
            path.unlink(missing_ok=True)
        else:
            fig.savefig(path, dpi=100)
            written.append(path)
    return written
