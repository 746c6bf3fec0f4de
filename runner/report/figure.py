"""What every plot of the report shares.

Its canvas (matplotlib's Agg, imported when a figure is made), its colours, and when an axis goes
logarithmic."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.report.runs import finite_or_none

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: A plot's axis is logarithmic when its positive values span more than this factor.
LOG_SPAN = 100.0


def figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def palette(n: int) -> list[Any]:
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    return [colormaps["viridis"](i / max(1, n - 1)) for i in range(n)]


def log_scale(values: list[Any]) -> bool:
    """Whether ``values`` need a log axis: their positive values span more than :data:`LOG_SPAN` times."""
    positive = [v for v in map(finite_or_none, values) if v is not None and v > 0]
    return bool(positive) and max(positive) > LOG_SPAN * min(positive)
