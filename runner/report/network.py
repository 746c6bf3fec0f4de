"""The network as an axis: which rule reached the target first at each link speed of a sweep.

For a sweep over ``simulate.link_gbps``: a sentence per speed, and the data of the crossover plot (each rule's
time to target against bandwidth, drawn by :func:`runner.report.crossover_plot.crossover_figure`).

A *series* is what the sweep varied besides the link speed and the seed (the rule, named by its value alone
when it is the only other key); a *cell* is a series at one speed: a point of :mod:`.confidence` (its seeds).
A cell reached the target when every seed of it that ended ok did; its time is their mean. Two times tie by
the report's noise rule (:func:`.confidence.tie`): their spreads over seeds overlap or lie within one
validation interval of each other, the time between the validation that reached the target and the one before
it (the crossing lies somewhere in it; the larger of the two cells'). Runs whose links are free
(``simulate.link_gbps`` or ``simulate.ranks_per_node`` unset) are the speed None, "free links", shown apart; a
link per node (``simulate.link_gbps=[1,1,1,0.05]``) is a speed of its own, a tuple, ordered by its slowest
link and left out of the plot's bandwidth axis. Nothing of this is written unless the runs differ in
``simulate.link_gbps``, in the kind of network (``network=``), or in ``simulate.link_latency_ms``: then each
cell is a :class:`Latency`, ordered from the slowest (the longest latency) and drawn against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from runner.report.confidence import REPEAT_KEYS, Point, Spread, tie
from runner.report.runs import Run, finite_or_none, short_value

#: The swept keys that make the network an axis (a link speed; a kind of network, conf/network/), and the
#: one that makes links at all.
LINK_KEY = "simulate.link_gbps"
NETWORK_KEY = "network"
LATENCY_KEY = "simulate.link_latency_ms"
NODES_KEY = "simulate.ranks_per_node"
#: The rule every other one is measured against.
BASELINE = "bsp"


@dataclass(frozen=True)
class Latency:
    """A sweep over latency's axis value: every node's one-way link latency in milliseconds."""

    ms: float

    def __str__(self) -> str:
        return f"{self.ms:g} ms latency"


#: A run's link speed: Gbit/s for every node, one per node, ``network=NAME`` (a sweep over kinds of
#: network), a latency (a sweep over it), or None (free links).
Speed = float | tuple[float, ...] | str | Latency | None
#: How the runs without links are called.
FREE = "free links"
#: The report's section on it.
HEADING = "Which rule reaches the target first at each link speed"
#: The same, over latency (``simulate.link_latency_ms``).
LATENCY_HEADING = "Which rule reaches the target first at each link latency"
#: The same, over kinds of network (``network=``).
NETWORK_HEADING = "Which rule reaches the target first on each network"


class Scored(Protocol):
    """What of a scored report (:class:`runner.report.table.Report`, which imports this module) is read."""

    keys: list[str]
    metric: str
    maximize: bool
    target: float | None

    @property
    def points(self) -> list[Point]: ...

    def target_text(self) -> str: ...


@dataclass
class Cell:
    """A series at one link speed (``gbps`` None: free links).

    Its point, and its time to target as a point of its own (``best``: the spread of its seeds' times;
    ``resolution``: one validation interval), or None where it did not reach the target."""

    series: str
    gbps: Speed
    point: Point
    time: Point | None

    @property
    def seconds(self) -> float | None:
        return None if self.time is None or self.time.best is None else self.time.best.mean


@dataclass
class Crossover:
    """The cells of a sweep over link speeds.

    ``series``: BSP first, then by name; ``speeds`` ascending (free links, None, last);
    ``cells[(series, speed)]``; ``target``: the report's target as text; ``maximize``: whether the metric's
    best is its highest (an accuracy) or its lowest (a loss)."""

    metric: str
    target: str
    series: list[str]
    speeds: list[Speed]
    cells: dict[tuple[str, Speed], Cell]
    maximize: bool

    def at(self, gbps: Speed) -> list[Cell]:
        """The cells at link speed ``gbps``, in the series' order."""
        return [c for s in self.series if (c := self.cells.get((s, gbps))) is not None]


def speed_of(run: Run, axis: str = LINK_KEY) -> Speed:
    """``run``'s link speed in Gbit/s, None where its links are free (no bandwidth, or no nodes).

    A tuple has one speed per node; on a sweep over kinds of network the speed is ``network=NAME``."""
    if axis == NETWORK_KEY and (name := (run.lookup(NETWORK_KEY) or (None, ""))[0]) is not None:
        return f"{NETWORK_KEY}={name}"
    if axis == LATENCY_KEY:
        ms = finite_or_none((run.lookup(LATENCY_KEY) or (None, ""))[0])
        return None if ms is None or speed_of(run) is None else Latency(ms)
    value = (run.lookup(LINK_KEY) or (None, ""))[0]
    if value is None:  # (a list in the run's config is not a lookup's value)
        value = run.config(("simulate", "link_gbps"))
    nodes = finite_or_none((run.lookup(NODES_KEY) or (None, ""))[0])
    if isinstance(value, (list, tuple)):
        each = [finite_or_none(v) for v in value]
        gbps: Speed = None if not each or None in each else tuple(v for v in each if v is not None)
    else:
        gbps = finite_or_none(value)
    return None if gbps is None or not nodes else gbps


def slowest(gbps: Speed) -> float:
    """The slowest link of ``gbps`` (0 for free links and a network's name)."""
    if isinstance(gbps, Latency):
        return gbps.ms
    return min(gbps) if isinstance(gbps, tuple) else gbps if isinstance(gbps, float) else 0.0


def series_name(run: Run, axis: str = LINK_KEY) -> str:
    """The series of ``run``: its swept values but the link speed and the seed.

    ``diloco`` when the rule is the only one, ``rule=diloco,rule.inner_steps=20`` otherwise; ``all runs`` when
    nothing else varied."""
    axes = (LINK_KEY, NETWORK_KEY, axis)  # (a sweep over link speeds keeps its latencies apart)
    keys = [k for k in run.swept if k not in (*axes, NODES_KEY, *REPEAT_KEYS)]
    if keys == ["rule"]:
        return str(run.swept["rule"])
    parts = [(k, run.lookup(k)) for k in keys]
    return ",".join(f"{k}={short_value(*v)}" for k, v in parts if v is not None) or "all runs"


def _time(point: Point) -> Point | None:
    """``point``'s time to target as a point, None unless each of its ok seeds reached the target.

    Its spread is that of its ok seeds' times, and one validation interval its resolution."""
    ok = [r for r in point.runs if r.ok]
    times = [r.target_time_s for r in ok]
    if not ok or any(t is None for t in times):
        return None
    return Point(point.name, ok, Spread.of(times), rule=point.rule, resolution=max(map(_interval, ok)))


def _interval(run: Run) -> float:
    """The time between the validation at which ``run`` reached the target and the one before it.

    Where in time the crossing lies; for the first validation, the time since training started."""
    times = [t for r in run.vals if (t := finite_or_none(r.get("time"))) is not None]
    hit = run.target_time_s
    before = [t for t in times if hit is not None and t < hit]
    return 0.0 if hit is None else hit - max(before, default=0.0)


def crossover(report: Scored) -> Crossover | None:
    """The report's cells by series and link speed.

    None unless its runs differ in ``simulate.link_gbps``, ``network`` or ``simulate.link_latency_ms`` (swept,
    two values at least, free links counting as one) and it has a target."""
    axis = next((k for k in (LINK_KEY, NETWORK_KEY, LATENCY_KEY) if k in report.keys), None)
    if axis is None or report.target is None:
        return None
    cells: dict[tuple[str, Speed], Cell] = {}
    order: dict[Speed, tuple] = {}  # a kind of network: by its slowest link, then its name
    for point in report.points:
        first = point.runs[0]
        key = (series_name(first, axis), speed_of(first, axis))
        cells.setdefault(key, Cell(*key, point, _time(point)))
        speed = key[1]
        links = speed_of(first) if isinstance(speed, str) else speed
        if isinstance(speed, Latency):  # the slowest first: the longest latency
            order.setdefault(speed, (False, -speed.ms, False, ""))
        else:
            order.setdefault(speed, (links is None, slowest(links), not isinstance(speed, float), str(speed)))
    speeds = sorted(order, key=order.__getitem__)
    if len(speeds) < 2:
        return None
    series = sorted({s for s, _ in cells}, key=lambda s: (s != BASELINE, s))
    return Crossover(report.metric, report.target_text(), series, speeds, cells, report.maximize)


def speed_text(gbps: Speed) -> str:
    """``0.1 Gbit/s``, ``1/1/0.05 Gbit/s by node``, or ``free links`` for None."""
    if isinstance(gbps, tuple):
        return "/".join(f"{g:g}" for g in gbps) + " Gbit/s by node"
    if isinstance(gbps, (str, Latency)):
        return str(gbps)
    return FREE if gbps is None else f"{gbps:g} Gbit/s"


def _s(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.3g} s"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _leaders(cells: list[Cell]) -> tuple[list[Cell], Cell | None]:
    """The cells that reached the target first at a speed, and the runner-up.

    The first with those that tie with it (fastest first), and the runner-up, the fastest one outside that
    group (None: none)."""
    reached = sorted((c for c in cells if c.time is not None), key=lambda c: c.seconds or 0.0)
    if not reached:
        return [], None
    first = [c for c in reached if c is reached[0] or tie(reached[0].time, c.time)]  # type: ignore[arg-type]
    rest = [c for c in reached if c not in first]
    return first, rest[0] if rest else None


def _final(cell: Cell) -> str:
    return "—" if cell.point.final is None else f"{cell.point.final.mean:.4f}"


def sentence(cross: Crossover, gbps: Speed) -> str:
    """The sentence for link speed ``gbps``: who reached the target first, a tie within noise, or none.

    The series that reached the target first and by how much (its time over the runner-up's and BSP's), a tie
    within noise, or that none reached it."""
    cells, where = cross.at(gbps), f"At {speed_text(gbps)}" if gbps is not None else "With free links"
    first, runner_up = _leaders(cells)
    if not first:
        best = [c for c in cells if c.point.best is not None]
        pick = max if cross.maximize else min
        top = pick(best, key=lambda c: c.point.best.mean) if best else None  # type: ignore[union-attr]
        near = f" (closest: {top.series}, best {cross.metric} {top.point.best.text()})" if top else ""
        return f"{where}, no rule reached {cross.target}{near}."
    lead = first[0]
    if len(first) > 1:
        times = _and([f"{c.series} {_s(c.seconds)}" for c in first])
        text = f"{where}, {_and([c.series for c in first])} tie in reaching {cross.target} first ({times}: "
        text += f"within one validation interval, {_s(max(c.time.resolution for c in first))}, of each other)"
        text += _too_coarse(first)
    else:
        text = f"{where}, {lead.series} reached {cross.target} first, in {_s(lead.seconds)}"
    text += _ratios(cells, first, runner_up)
    return text + f"; final {cross.metric} {_finals(cells, first)}."


def _too_coarse(first: list[Cell]) -> str:
    """Where a tied cell reached the target at its first validation: that, and the fix.

    Its interval is then all of its time, so the tie says only that the validations came too late to tell."""
    early = [
        c.series for c in first if c.time is not None and c.time.resolution >= (c.seconds or 0.0) * 0.999
    ]
    if not early:
        return ""
    return (
        f", {_and(early)} reaching it at {'its' if len(early) == 1 else 'their'} first validation: too few "
        "validations to tell them apart (validate more often, e.g. train.val_every=0.25, or set a harder "
        "target)"
    )


def _ratios(cells: list[Cell], first: list[Cell], runner_up: Cell | None) -> str:
    """``: 0.45× the runner-up gosgd's 2.7 s, 0.15× bsp's 8 s``: the first's time over theirs."""
    lead, parts = first[0], []
    if runner_up is not None:
        ratio = (lead.seconds or 0.0) / (runner_up.seconds or 1.0)
        parts.append(f"{ratio:.2g}× the runner-up {runner_up.series}'s {_s(runner_up.seconds)}")
    elif len(cells) > len(first):
        parts.append("no other rule reached it")
    base = _baseline(cells)
    if base is not None and base not in first and base is not runner_up:
        if base.seconds is None:
            parts.append(f"{base.series} did not reach it")
        else:
            parts.append(f"{(lead.seconds or 0.0) / base.seconds:.2g}× {base.series}'s {_s(base.seconds)}")
    return (": " + ", ".join(parts)) if parts else ""


def _finals(cells: list[Cell], first: list[Cell]) -> str:
    """The final metric of the first (and those tied with it), and BSP's beside it."""
    named = [f"{c.series} {_final(c)}" for c in first]
    base = _baseline(cells)
    if base is not None and base not in first:
        named.append(f"{base.series} {_final(base)}")
    return _and(named)


def _baseline(cells: list[Cell]) -> Cell | None:
    """The BSP cell (named ``bsp``, else the first whose rule is BSP), None where the sweep has none."""
    ours = [c for c in cells if c.point.rule == BASELINE]
    return next((c for c in ours if c.series == BASELINE), ours[0] if ours else None)


def explanation(cross: Crossover) -> str:
    """The paragraph under the sentences: what a time is, when two tie, what the ratios are."""
    return (
        f"Time to target: from the start of training to the first validation that reached {cross.target}, "
        "emulated link time included; a rule at a speed is one point (its seeds' mean, reached only if each "
        "seed that ended ok reached it). Two times tie when their spreads over seeds overlap or lie within "
        "one validation interval (the time since the validation before the one that reached the target) "
        f"of each other. Ratios: the first's time over the runner-up's and {BASELINE}'s (0.2×: five times "
        f"as fast). {FREE.capitalize()}: runs without emulated links ({LINK_KEY} or {NODES_KEY} unset). The "
        "crossover plot draws each rule's time against the link speed."
    )


def sentences(cross: Crossover) -> list[str]:
    """A sentence per link speed, slowest first, free links last."""
    return [sentence(cross, gbps) for gbps in cross.speeds]


def section(cross: Crossover) -> list[str]:
    """The section's list: :func:`sentences`, then whether the lines cross where they do not."""
    return sentences(cross) + ([no_cross] if (no_cross := no_crossover(cross)) else [])


def firsts(cross: Crossover) -> list[tuple[Speed, list[str]]]:
    """The series first to the target at each link speed (several: a tie; none: none reached it)."""
    return [(gbps, [c.series for c in _leaders(cross.at(gbps))[0]]) for gbps in cross.speeds]


def _reached(cross: Crossover) -> list[tuple[Speed, list[str]]]:
    """The emulated speeds (free links left out) where any series reached the target, with the first."""
    return [(g, names) for g, names in firsts(cross) if g is not None and names]


def no_crossover(cross: Crossover) -> str | None:
    """The sentence saying the lines do not cross; None where they do.

    They do not cross where one series is first, alone or tied, at every emulated speed where any reached the
    target; None also where there are fewer than two such speeds."""
    reached = _reached(cross)
    if len(reached) < 2:
        return None
    always = set.intersection(*(set(names) for _, names in reached))
    if not always:
        return None
    lo, hi = speed_text(reached[0][0]), speed_text(reached[-1][0])
    every = "on every network" if _axis(cross) == "network" else f"at every {_axis(cross)}"
    who = _and(sorted(always))
    first = f"{who} reached {cross.target} first (or tied first)"
    return f"No crossover in this range: {first} {every} from {lo} to {hi}."


def headline(cross: Crossover) -> tuple[str, str]:
    """The report's first line for a sweep over link speeds, which answers what it varied.

    The first to the target at each speed (in bold), and whether the lines cross."""
    parts = []
    for gbps, names in firsts(cross):
        who = "none reached it" if not names else names[0] if len(names) == 1 else f"a tie of {_and(names)}"
        parts.append(f"{speed_text(gbps)}: {who}")
    if len(_reached(cross)) < 2:  # (one speed, or none, where any reached it: nothing crosses or stays apart)
        crossing = "the target was reached at fewer than two emulated link speeds: no crossover to tell"
    else:
        crossing = "no crossover in this range" if no_crossover(cross) else "the lines cross"
    return f"First to {cross.target}, by {_axis(cross)}: {'; '.join(parts)}", f"({crossing})"


def summary_line(cross: Crossover) -> str:
    """The console's last line for such a sweep: the first at each speed, briefly."""
    parts = []
    for gbps, names in firsts(cross):
        parts.append(f"{speed_text(gbps)} {'none' if not names else '='.join(names)}")
    return f"first to {cross.target} by {_axis(cross)}: {', '.join(parts)}"


def heading(cross: Crossover) -> str:
    """The report's section title for ``cross``."""
    return {"network": NETWORK_HEADING, "link latency": LATENCY_HEADING}.get(_axis(cross), HEADING)


def _axis(cross: Crossover) -> str:
    """What the sweep varied: ``network`` (its kinds of network), ``link latency`` or ``link speed``."""
    if any(isinstance(g, str) for g in cross.speeds):
        return "network"
    return "link latency" if any(isinstance(g, Latency) for g in cross.speeds) else "link speed"


def grid(cross: Crossover) -> tuple[list[str], list[list[str]]]:
    """A table: a row per series, a column per speed, each cell its time to target and final metric."""
    header = ["rule", *(f"{speed_text(g)}: time to target (final {cross.metric})" for g in cross.speeds)]
    rows = []
    for series in cross.series:
        row = [series]
        for gbps in cross.speeds:
            cell = cross.cells.get((series, gbps))
            if cell is None:
                row.append("no run")
            elif not cell.point.ok:
                row.append(f"no run ok ({cell.point.runs[0].status})")
            else:
                time = "not reached" if cell.time is None else _s(cell.seconds)
                row.append(f"{time} ({_final(cell)})")
        rows.append(row)
    return header, rows
