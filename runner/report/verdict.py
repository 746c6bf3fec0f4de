"""The report's sentences on how sure it is.

The best point (or a tie), the ranking with its ties, the model scored per rule with the others beside it, and
how noise was judged (:mod:`runner.report.confidence`)."""

from __future__ import annotations

import math

from runner.report.confidence import (
    EPSILON,
    RANGE_UP_TO,
    REPEAT_KEYS,
    Point,
    Standing,
    gap,
    other_name,
    scored_model,
)
from runner.report.runs import Run

#: How to repeat a point with seeds, as the report suggests it.
REPEAT_HINT = f"-m ... {REPEAT_KEYS[0]}=1,2,3"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _sample(resolution: float) -> str:
    return f"one validation sample (1/{round(1 / resolution)})"


def why_tied(group: list[Point]) -> str:
    """Why the points of ``group`` (best first) tie.

    Within one validation sample (one seed each), or spreads that overlap (or lie within one sample)."""
    resolution = max(p.resolution for p in group)
    if all(p.best is not None and p.best.n == 1 for p in group):
        return f"within {_sample(resolution)} of each other" if resolution else "equal"
    if all(any(gap(p, q) <= EPSILON for q in group[:i]) for i, p in enumerate(group) if i):
        return "their spreads overlap"
    return f"their spreads overlap or lie within {_sample(resolution)} of each other"


def headline(standing: Standing) -> tuple[str, str]:
    """The report's first line: what is best, and its numbers.

    What is best: the best run; a point's mean over its seeds; or a tie."""
    m, groups = standing.metric, standing.groups
    if not groups:
        return "No run ended ok with a recorded metric.", ""
    top = groups[0]
    if len(top) > 1:
        values = _and([p.best.text() for p in top if p.best is not None])
        return f"No clear best: {_and([p.name for p in top])} tie", f"(best {m} {values}: {why_tied(top)})"
    point = top[0]
    assert point.best is not None, "ranked points are ok"
    run = _single(point)
    if run is not None:
        return f"Best run: {run.name}", f"({m} {point.best.text()}, {run.dir})"
    return f"Best point: {point.name}", f"(best {m}, mean over its seeds: {point.best.text()})"


def _single(point: Point) -> Run | None:
    """The one run of ``point`` that scored, if it has one (it is then named as a run, not a point)."""
    scored = [r for r in point.runs if r.ok and r.best is not None]
    return scored[0] if len(scored) == 1 else None


def verdict(standing: Standing) -> str:
    """One line for the terminal: the best run or point and its metric, or the points that tie."""
    groups = standing.groups
    if not groups:
        return "none"
    if len(groups[0]) > 1:
        return f"a tie: {_and([p.name for p in groups[0]])} ({standing.metric} within noise)"
    point = groups[0][0]
    assert point.best is not None, "ranked points are ok"
    run = _single(point)
    return f"{point.name if run is None else run.name}, {standing.metric} {point.best.text()}"


def ranking(standing: Standing) -> str | None:
    """The ranking sentence; None with fewer than two ranked points.

    E.g. ``Ranking by best val_acc: 1. A at 0.9944 and B at 0.9917 tie: within one validation sample (1/360)
    of each other; 3. C at 0.9000.``"""
    groups = standing.groups
    if sum(len(g) for g in groups) < 2:
        return None
    parts, place = [], 1
    for group in groups:
        named = _and([f"{p.name} at {p.best.text()}" for p in group if p.best is not None])
        parts.append(f"{place}. {named}" + (f" tie: {why_tied(group)}" if len(group) > 1 else ""))
        place += len(group)
    repeated = " (mean over seeds where repeated)" * standing.repeated
    return f"Ranking by best {standing.metric}{repeated}: " + "; ".join(parts) + "."


def noise(standing: Standing) -> str | None:
    """How the report judged noise: the spread it shows and when two points tie (None: nothing compared)."""
    ok = [p for g in standing.groups for p in g]
    if len(ok) < 2 and not standing.repeated:
        return None
    resolution = max(p.resolution for p in ok)
    sample = f" or lie within {_sample(resolution)} of each other" if resolution else ""
    if standing.repeated:
        return (
            f"A point is the runs that differ only in {', '.join(REPEAT_KEYS)}: its mean with its spread, "
            f"for n ≤ {RANGE_UP_TO} seeds the range (min–max), for more ± the sample standard deviation; "
            f"n counts the runs that ended ok. Two points tie when their spreads overlap{sample}."
        )
    if resolution:
        return (
            f"One seed per point: runs within {_sample(resolution)} of each other tie; repeat each point "
            f"with seeds ({REPEAT_HINT}) to see its spread."
        )
    return (
        f"One seed per point and no validation size recorded for {standing.metric} (older runs, or a metric "
        f"that does not count samples): differences are not tested against noise; repeat each point with "
        f"seeds ({REPEAT_HINT}) to know."
    )


def scored(standing: Standing) -> str | None:
    """Which model is scored per rule (the one model.pt keeps), and the others shown beside it."""
    rules = list(dict.fromkeys(p.rule for p in standing.points if p.rule))
    if not rules:
        return None
    each = "; ".join(f"{rule}: {scored_model(rule)}" for rule in rules)
    text = f"Scored model (what each run reports and saves as model.pt, the one a user keeps): {each}."
    others = dict.fromkeys(k for p in standing.points for k in p.others)
    for prefix in others:
        having = _and(list(dict.fromkeys(str(p.rule) for p in standing.points if prefix in p.others)))
        text += f" Shown beside it, not ranked: {having}'s {other_name(prefix)}."
    return text


def others_ahead(standing: Standing) -> list[str]:
    """A line for each point whose other model did better than its scored one by more than noise.

    The other model: EASGD's workers' mean."""
    lines = []
    for p in standing.points:
        if p.best is None:
            continue
        for prefix, spread in p.others.items():
            margin = spread.low - p.best.high if standing.maximize else p.best.low - spread.high
            if margin > p.resolution + EPSILON:
                lines.append(
                    f"{p.name}: its {other_name(prefix)} reached best {standing.metric} {spread.text()}, "
                    f"its scored {scored_model(p.rule).removeprefix('the ')} {p.best.text()}; model.pt "
                    f"keeps the latter (--metric {prefix}_{standing.metric} ranks by the former)."
                )
    return lines


def final_behind(standing: Standing) -> str | None:
    """The points whose saved (final) model fell behind their ranked best validation by more than noise.

    The ranking is by the best, ``model.pt`` holds the final model."""
    behind = []
    for p in standing.points:
        if p.best is None or p.final is None or (p.best.n < 2 and not p.resolution):
            continue  # (one run of a metric that counts nothing, a loss: its noise is unknown)
        margin = p.final.low - p.best.high if not standing.maximize else p.best.low - p.final.high
        if margin > p.resolution + EPSILON:
            behind.append(f"{p.name} (best {p.best.text()}, final {p.final.text()})")
    if not behind:
        return None
    return (
        f"Ranked by best {standing.metric}, but each run saves its final model (model.pt), which fell behind "
        f"its best by more than noise for {_and(behind)}: compare the final {standing.metric} (the runs' "
        "table) before keeping one."
    )


def paragraphs(standing: Standing) -> list[str]:
    """The sentences under the headline.

    The ranking, the model scored per rule, how noise was judged, the points whose other model did better, and
    those whose saved (final) model fell behind their best."""
    texts = [
        ranking(standing),
        scored(standing),
        noise(standing),
        *others_ahead(standing),
        final_behind(standing),
    ]
    return [t for t in texts if t]


def points_table(standing: Standing) -> tuple[list[str], list[list[str]]]:
    """The header and cells of the points' table (seeds repeated).

    Each point's runs ok of all, its best and final metric and its other models' best as mean and spread, its
    mean steps to target."""
    m = standing.metric
    others = list(dict.fromkeys(k for p in standing.points for k in p.others))
    header = ["point", "runs ok", f"best {m}", f"final {m}", *(f"best {m}: {other_name(k)}" for k in others)]
    cells = []
    for p in standing.points:
        spreads = [p.best, p.final, *(p.others.get(k) for k in others)]
        steps = "—" if p.steps() == math.inf else f"{p.steps():,.0f}"
        ok = f"{sum(r.ok for r in p.runs)} of {len(p.runs)}"
        cells.append([p.name, ok, *("—" if s is None else s.text() for s in spreads), steps])
    return header + ["steps to target (mean)"], cells
