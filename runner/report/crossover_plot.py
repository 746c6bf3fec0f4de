"""The crossover plot.

Each rule's time to target against the emulated link bandwidth (:mod:`runner.report.network` computes it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.report import network
from runner.report.figure import figure, log_scale, palette

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def crossover_figure(cross: network.Crossover) -> Figure:
    """The crossover plot.

    A line per series through its time to target at each link speed (log x axis; log y where the times span
    orders of magnitude), a cross at the top where it did not reach the target, and free links apart, in a
    narrow panel of their own on the right."""
    latency = any(isinstance(g, network.Latency) for g in cross.speeds)
    on_axis = (network.Latency,) if latency else (float,)
    speeds = [g for g in cross.speeds if isinstance(g, on_axis)]  # (a link per node has no place on the axis)
    free = None in cross.speeds
    fig = figure(9.5 if free else 8, 5.6)
    if free:
        axes, apart = fig.subplots(1, 2, sharey=True, width_ratios=[5, 1])
    else:
        axes, apart = fig.subplots(), None
    colors = dict(zip(cross.series, palette(len(cross.series)), strict=True))
    for series in cross.series:
        cells = [c for g in speeds if (c := cross.cells.get((series, g))) is not None]
        _draw_cells(axes, cells, series, colors[series])
        if apart is not None and (cell := cross.cells.get((series, None))) is not None:
            _draw_cells(apart, [cell], f"{series}: {network.FREE}", colors[series], x=0.0)
    times = [c.seconds for c in cross.cells.values() if c.seconds is not None]
    log = log_scale(times)
    xs = [network.slowest(g) for g in speeds]
    axes.set_xscale("log" if min(xs, default=1.0) > 0 else "symlog")
    axes.set_xticks(xs, [f"{x:g}" for x in xs])
    axes.set_yscale("log" if log else "linear")
    if not log:
        axes.set_ylim(0, max(times, default=1.0) * 1.15)
    axes.set_xlabel(
        "emulated one-way link latency (ms, log scale)"
        if latency
        else "emulated link bandwidth per node (Gbit/s, log scale)"
    )
    axes.set_ylabel("time to target from the start of training (s)" + " (log scale)" * log)
    axes.grid(alpha=0.3, which="both")
    if any(c.seconds is None for c in cross.cells.values()):
        axes.plot([], [], "x", color="grey", label="not reached (drawn at the top)")
    if apart is not None:
        apart.set_xticks([0], [network.FREE])
        apart.set_xlim(-1, 1)
        apart.grid(alpha=0.3)
        apart.set_title("links free", fontsize=10)
    axes.legend(fontsize=9)
    crossing = "; no crossover in this range" if network.no_crossover(cross) else ""
    against = "link latency" if latency else "link bandwidth"
    fig.suptitle(f"Time to {cross.target} against {against}, per rule{crossing}", fontsize=12)
    return fig


def _draw_cells(
    axes: Axes, cells: list[network.Cell], label: str, color: object, x: float | None = None
) -> None:
    """One series' line through the cells that reached the target (gid.

    ``label``) and a cross at the top of the axes for each that did not (gid: ``label: not reached``); ``x``
    for all, else each speed."""
    from matplotlib.transforms import blended_transform_factory

    def at(cell: network.Cell) -> float:
        return x if x is not None else network.slowest(cell.gbps)

    hit = [c for c in cells if c.seconds is not None]
    if hit or x is None:
        line = axes.plot([at(c) for c in hit], [c.seconds for c in hit], marker="o", color=color, gid=label)
        line[0].set_label(label if x is None else "_" + label)
    missed = [at(c) for c in cells if c.seconds is None]
    if missed:
        top = blended_transform_factory(axes.transData, axes.transAxes)
        axes.plot(
            missed,
            [0.97] * len(missed),
            "x",
            color=color,
            markersize=9,
            transform=top,
            gid=f"{label}: not reached",
        )
