"""How sure the report is: the seeds of one point, and which points tie within noise.

Runs that differ only in their seed are one point (mean ± spread), and points whose difference is within noise
are called a tie.

A point's spread: with n ≤ :data:`RANGE_UP_TO` seeds the range (min–max: every value is inside it; a standard
deviation of two or three values is too uncertain to print), with more the sample standard deviation (mean ±
std). Two points tie when their intervals (one seed: the value; n ≤ 3: [min, max]; more: mean ± std) overlap
or lie within one validation sample of each other: 1/``val_count`` (the items a validation counts, recorded in
summary.json) for a metric that counts them (an accuracy); 0 for others (a loss), and for runs older than the
record.

The model scored is the one the run reports, which ``model.pt`` keeps (:data:`SCORED` names it per rule); a
rule's other validated models (EASGD's workers' mean) are shown beside it, not ranked.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from runner.report.runs import Run, finite_or_none, short_value

#: Swept keys whose values are repeats of the same point (``-m ... train.seed=1,2,3``).
REPEAT_KEYS = ("train.seed",)
#: Up to this many seeds a point's spread is its range (min–max); beyond, its standard deviation.
RANGE_UP_TO = 3
#: Differences below this are rounding (an accuracy is a count over val_count).
EPSILON = 1e-9
#: The model each rule reports, scores and saves as model.pt: what a user keeps of the run.
SCORED = {
    "bsp": "the workers' model (the same on every worker)",
    "asgd": "the servers' model",
    "async_diloco": "the servers' model (the outer parameters x)",
    "easgd": "the center x̃",
    "gosgd": "the consensus Σ a_i·x_i (the workers' weighted mean)",
    "diloco": "the workers' mean",
    "streaming_diloco": "the workers' mean",
    "sparta": "the workers' mean",
    "desloc": "the workers' mean",
    "sparseloco": "the workers' mean",
    "demo": "the workers' model (the same on every worker)",
}
#: A rule's other validated models, by record prefix (``worker_mean_val_acc``): their name in the report.
OTHERS = {"worker_mean": "workers' mean model"}
#: The ending of a metric that counts validation items (one item: 1/val_count of it).
COUNTED = ("acc", "top5")


@dataclass(frozen=True)
class Spread:
    """A point's values of a metric over its seeds: the mean and the interval ties are judged on."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float | None]) -> Spread | None:
        kept = tuple(v for v in values if v is not None)
        return cls(kept) if kept else None

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if self.n > 1 else 0.0

    @property
    def low(self) -> float:
        return min(self.values) if self.n <= RANGE_UP_TO else self.mean - self.std

    @property
    def high(self) -> float:
        return max(self.values) if self.n <= RANGE_UP_TO else self.mean + self.std

    def text(self) -> str:
        """``0.9944`` (one seed), ``0.9611 (range 0.9556–0.9639, n=3)``, ``0.9611 ± 0.0030 (n=5)``."""
        if self.n == 1:
            return f"{self.values[0]:.4f}"
        if min(self.values) == max(self.values):
            return f"{self.mean:.4f} (n={self.n}, all alike)"
        if self.n <= RANGE_UP_TO:
            return f"{self.mean:.4f} (range {self.low:.4f}–{self.high:.4f}, n={self.n})"
        return f"{self.mean:.4f} ± {self.std:.4f} (n={self.n})"


@dataclass
class Point:
    """The runs of one sweep point (its seeds), their spreads, the rule and the resolution.

    Their best metric's spread (ok runs only), their other models' (by record prefix), the rule, and one
    validation sample's worth of the metric (0: unknown)."""

    name: str
    runs: list[Run]
    best: Spread | None = None
    final: Spread | None = None
    others: dict[str, Spread] = field(default_factory=dict)
    rule: str | None = None
    resolution: float = 0.0

    @property
    def ok(self) -> bool:
        return self.best is not None

    def steps(self) -> float:
        """The mean steps to target of its ok runs (infinite: none reached it), which breaks equal means."""
        steps = [s for r in self.runs if r.ok and (s := finite_or_none(r.target_step)) is not None]
        return statistics.fmean(steps) if steps else math.inf


def point_name(run: Run) -> str:
    """``run``'s name without its repeat keys (``rule=easgd`` of ``rule=easgd,train.seed=2``)."""
    parts = [(k, run.lookup(k)) for k in run.swept if k not in REPEAT_KEYS]
    return ",".join(f"{k}={short_value(*v)}" for k, v in parts if v is not None) or "all runs"


def counted(metric: str) -> bool:
    """Whether ``metric`` is a fraction of counted validation items (an accuracy), so one item is a step."""
    return metric.endswith(COUNTED)


def points(runs: list[Run], metric: str, maximize: bool) -> list[Point]:
    """``runs`` (scored) grouped by their swept values without :data:`REPEAT_KEYS`, best mean first.

    Equal means: fewer steps to target first; points without an ok run last, in the runs' order."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        key = tuple(sorted((k, repr(v)) for k, v in run.swept.items() if k not in REPEAT_KEYS))
        groups.setdefault(key, []).append(run)
    made = [_point(members, metric) for members in groups.values()]
    sign = -1 if maximize else 1
    return sorted(made, key=lambda p: (not p.ok, sign * p.best.mean if p.ok else 0.0, p.steps()))


def _point(runs: list[Run], metric: str) -> Point:
    ok = [r for r in runs if r.ok]
    prefixes = dict.fromkeys(k for r in ok for k in r.others)
    others = {k: s for k in prefixes if (s := Spread.of([r.others.get(k) for r in ok])) is not None}
    counts = [c for r in ok if (c := finite_or_none(r.summary.get("val_count"))) and c > 0]
    rule = next((str(v[0]) for r in runs if (v := r.lookup("rule")) is not None), None)
    return Point(
        point_name(runs[0]),
        runs,
        Spread.of([r.best for r in ok]),
        Spread.of([r.final for r in ok]),
        others,
        rule,
        1 / min(counts) if counts and counted(metric) else 0.0,
    )


def tie(a: Point, b: Point) -> bool:
    """Whether ``a`` and ``b`` (ok points) are within noise of each other.

    Their intervals overlap or lie within one validation sample (the larger of theirs) of each other."""
    return gap(a, b) <= max(a.resolution, b.resolution) + EPSILON


def gap(a: Point, b: Point) -> float:
    """The distance between the intervals of ``a`` and ``b`` (ok points); 0 or less where they overlap."""
    assert a.best is not None and b.best is not None, "only ok points are compared"
    return max(a.best.low, b.best.low) - min(a.best.high, b.best.high)


def ranked(found: list[Point]) -> list[list[Point]]:
    """The ok points, best first, in groups of ties.

    A point joins the group above when it ties with any of its points (so no order is claimed between two
    points that tie)."""
    groups: list[list[Point]] = []
    for point in (p for p in found if p.ok):
        if groups and any(tie(point, q) for q in groups[-1]):
            groups[-1].append(point)
        else:
            groups.append([point])
    return groups


@dataclass
class Standing:
    """A report's points scored on ``metric`` (best first) and their ranking in groups of ties."""

    metric: str
    maximize: bool
    points: list[Point]
    groups: list[list[Point]]

    @classmethod
    def of(cls, runs: list[Run], metric: str, maximize: bool) -> Standing:
        """The standing of ``runs``, scored on ``metric``."""
        found = points(runs, metric, maximize)
        return cls(metric, maximize, found, ranked(found))

    @property
    def repeated(self) -> bool:
        """Whether a point has more than one seed that ended ok."""
        return any(p.best is not None and p.best.n > 1 for p in self.points)


def scored_model(rule: Any) -> str:
    """What the report scores of a run of ``rule``: the model it reports and saves as model.pt."""
    return SCORED.get(str(rule), "the model the rule reports (model.pt)")


def other_name(prefix: str) -> str:
    return OTHERS.get(prefix, f"{prefix.replace('_', ' ')} model")
