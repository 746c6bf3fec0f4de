"""The schemas of the top-level sections of ``conf/config.yaml``.

The sections are ``train``, ``checkpoint``, ``simulate`` and ``sweep``. Like the groups' schemas, each holds
its keys' defaults and checks; :mod:`runner.schema.config` puts them together.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from runner.schema import one_of, require

#: ``train.precision``: the forward pass's type under autocast (fp16 with a gradient scaler, GPUs only).
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32
    val_batch_size: int = 256
    val_samples: int | None = None
    seed: int = 0
    val_every: float = 1
    val_every_s: float | None = None
    log_every: int = 10
    max_steps: int | None = None
    save_model: str = "rank0"
    progress: bool = True
    same_init: bool = True
    on_nonfinite: str = "stop"
    diverge_at: float | None = 100.0
    #: A classifier that ends near chance after having been well above it ends diverged (runner/rank/guard.py,
    #: ``fell_to_chance``): near is within this fraction of the way from chance to a perfect accuracy.
    collapse_margin: float | None = 0.15
    stall_timeout: float | None = 300.0
    precision: str = "fp32"
    accumulate: int = 1
    grad_clip: float | None = None
    monitor: str | None = None
    early_stop: int | None = None

    def __post_init__(self) -> None:
        require(self.epochs >= 1, "epochs", self.epochs, "train for at least one epoch (train.epochs=10)")
        require(self.batch_size >= 1, "batch_size", self.batch_size, "the per-rank batch must be >= 1")
        require(self.val_batch_size >= 1, "val_batch_size", self.val_batch_size, "must be >= 1")
        require(
            self.val_samples is None or self.val_samples >= 1,
            "val_samples",
            self.val_samples,
            "validate on this many samples spread evenly over the validation set, >= 1 (e.g. "
            "train.val_samples=512), or null for all of it",
        )
        self._check_validations()
        require(self.log_every >= 1, "log_every", self.log_every, "log every N >= 1 steps")
        require(
            self.max_steps is None or self.max_steps >= 1,
            "max_steps",
            self.max_steps,
            "use null for no limit or a positive step count",
        )
        one_of("save_model", self.save_model, ("rank0", "all", "none"))
        one_of("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        require(
            self.diverge_at is None or (math.isfinite(self.diverge_at) and self.diverge_at > 1),
            "diverge_at",
            self.diverge_at,
            "a multiple of the run's first validation loss, > 1 (e.g. 100), or null to never call a finite "
            "loss diverged",
        )
        require(
            self.collapse_margin is None or 0 < self.collapse_margin < 0.5,
            "collapse_margin",
            self.collapse_margin,
            "a fraction of the way from chance to a perfect accuracy, 0 < margin < 0.5 (e.g. 0.15), or null "
            "to end a run that fell to chance ok",
        )
        require(
            self.stall_timeout is None or self.stall_timeout > 0,
            "stall_timeout",
            self.stall_timeout,
            "seconds without progress before the job is ended, > 0 (e.g. 300), or null to never end it",
        )
        one_of("precision", self.precision, PRECISIONS)
        require(
            self.accumulate >= 1,
            "accumulate",
            self.accumulate,
            "batches of gradients summed per optimizer step, >= 1 (1: no accumulation)",
        )
        require(
            self.grad_clip is None or (math.isfinite(self.grad_clip) and self.grad_clip > 0),
            "grad_clip",
            self.grad_clip,
            "the largest gradient norm, > 0 (e.g. train.grad_clip=1.0), or null for no clipping",
        )
        require(
            self.early_stop is None or self.early_stop >= 1,
            "early_stop",
            self.early_stop,
            "validations without improvement of train.monitor before stopping, >= 1, or null",
        )

    def _check_validations(self) -> None:
        """``val_every`` and ``val_every_s``: each valid, and one schedule within epochs."""
        require(
            0 < self.val_every < 1 or (self.val_every >= 1 and float(self.val_every).is_integer()),
            "val_every",
            self.val_every,
            "validate every N epochs: a whole number >= 1, or a fraction of an epoch's samples below 1 "
            "(e.g. 0.25: four times an epoch)",
        )
        require(
            self.val_every_s is None or (math.isfinite(self.val_every_s) and self.val_every_s > 0),
            "val_every_s",
            self.val_every_s,
            "seconds of training between validations, > 0 (e.g. train.val_every_s=30), or null",
        )
        require(
            self.val_every_s is None or self.val_every >= 1,
            "val_every_s",
            self.val_every_s,
            f"train.val_every={self.val_every:g} also validates within epochs: keep one of the two "
            "(train.val_every=1 with train.val_every_s, or train.val_every_s=null)",
        )


@dataclass
class CheckpointConfig:
    """When checkpoints are written (one is always written at the end of a run and on preemption)."""

    every: int | None = None
    every_minutes: float | None = 30.0
    keep: int = 2

    def __post_init__(self) -> None:
        require(
            self.every is None or self.every >= 1,
            "every",
            self.every,
            "steps between checkpoints, >= 1 (e.g. checkpoint.every=500), or null",
        )
        require(
            self.every_minutes is None or self.every_minutes > 0,
            "every_minutes",
            self.every_minutes,
            "minutes between checkpoints, > 0 (e.g. 30), or null",
        )
        require(self.keep >= 1, "keep", self.keep, "keep at least the latest checkpoint (checkpoint.keep=2)")


@dataclass
class SweepConfig:
    """How a sweep (``-m``) treats its points.

    ``fail_fast`` starts no further point once one failed; ``retry``: ``resume=SWEEP_DIR`` runs the points
    that failed again (false: keeps them as they ended); ``zip``: keys whose values vary together, the i-th of
    each in one point. Read by the sweep (:mod:`runner.launcher.sweeper`), not by the ranks."""

    retry: bool = True
    fail_fast: bool = False
    zip: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key in ("retry", "fail_fast"):
            value = getattr(self, key)
            require(isinstance(value, bool), key, value, f"true or false (e.g. sweep.{key}=true)")
        require(
            len(set(self.zip)) == len(self.zip) and len(self.zip) != 1,
            "zip",
            self.zip,
            "two or more different keys whose values vary together "
            "(sweep.zip=[optim.lr,schedule.warmup_steps]), or [] to cross every key's values",
        )


def _numbers(value: Any, ok: Callable[[float], bool]) -> bool:
    """Whether ``value`` is a finite number, or a non-empty list of them, each ``ok``."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return bool(values) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok(v) for v in values
    )


def _shown(value: Any) -> str:
    """A number or a list of them as the command line gives it (``0.1``, ``[1,1,0.05]``)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(f"{v:g}" for v in value) + "]"
    return f"{value:g}"


@dataclass
class LinkEventConfig:
    """Emulated node ``node``'s link carries ``gbps`` Gbit/s from ``at_s`` for ``for_s`` seconds.

    Seconds of the job's clock. ``gbps`` null: the link is down, and what crosses it waits until it is
    back."""

    node: int = MISSING
    at_s: float = MISSING
    for_s: float = MISSING
    gbps: float | None = None


@dataclass
class SimulateConfig:
    """Conditions imposed on a healthy job to study the rules under them.

    ``straggler_ranks`` (worker ranks, ``0 .. devices-1``) each sleep ``straggler_ms`` milliseconds at the
    start of every training step, a worker whose compute is that much slower. Either one empty or zero leaves
    the job as it is, with a warning when the other is set (so a sweep may include the no-straggler point).
    ``jitter_ms``: every worker also sleeps a delay of its own per step, drawn once from [0, jitter_ms]
    (seeded by its rank): workers of random speeds. ``spin``: the delays are spent spinning on the CPU instead
    of sleeping, as a slower machine would spend them computing: on a machine with fewer cores than ranks a
    sleeping worker gives its core to the others, which then run faster than beside a slow machine.

    Emulated links (:mod:`runner.comm.links`): the job's ranks, in rank order, make nodes of
    ``ranks_per_node`` each, whose links carry ``link_gbps`` Gbit/s; every message or collective that crosses
    a node boundary costs ``link_latency_ms`` per round of its algorithm (a ring all-reduce of N ranks:
    2(N-1)) plus its bytes over the bandwidth, spent after the real operation (slept, or spun with ``spin``).
    Each of the two is one value for every node or a list of one per node (``[1,1,1,0.05]``: the fourth node
    at 50 Mbit/s); a node past the list (a rule's server, a worker that joined) takes its last value. Either
    one unset leaves the links free, with a warning when the other is set (a sweep may include the point
    without links). The latency's default, 0.05 ms, is a one-way TCP message between hosts on one Ethernet
    switch (tens of microseconds), the transport Open MPI takes between nodes without InfiniBand.
    ``link_events``: times a node's link slows down or goes away and comes back (:class:`LinkEventConfig`),
    recorded in ``metrics.jsonl`` as ``link`` records."""

    straggler_ranks: list[int] = field(default_factory=list)
    straggler_ms: float = 0.0
    jitter_ms: float = 0.0
    spin: bool = False
    ranks_per_node: int | None = None
    link_gbps: Any = None  # a number, or a list of one per emulated node
    link_latency_ms: Any = 0.05  # the same
    link_events: list[LinkEventConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        require(
            math.isfinite(self.straggler_ms) and self.straggler_ms >= 0,
            "straggler_ms",
            self.straggler_ms,
            "the delay per training step in milliseconds, >= 0 (e.g. simulate.straggler_ms=30)",
        )
        require(
            math.isfinite(self.jitter_ms) and self.jitter_ms >= 0,
            "jitter_ms",
            self.jitter_ms,
            "the largest of the workers' own delays per step in milliseconds, >= 0 (e.g. 20)",
        )
        require(
            len(set(self.straggler_ranks)) == len(self.straggler_ranks),
            "straggler_ranks",
            self.straggler_ranks,
            "name each rank once (e.g. simulate.straggler_ranks=[1,3])",
        )
        self.check_links()

    def check_links(self) -> None:
        """The emulated links' keys: ranks per node >= 0, a bandwidth > 0, a latency >= 0."""
        require(
            self.ranks_per_node is None or self.ranks_per_node >= 0,
            "ranks_per_node",
            self.ranks_per_node,
            "ranks per emulated node, >= 1 (e.g. simulate.ranks_per_node=1: a node per rank), or null: none",
        )
        gbps, latency = self.link_gbps, self.link_latency_ms
        require(
            gbps is None or _numbers(gbps, lambda v: v > 0),
            "link_gbps",
            gbps,
            "each emulated node's link in Gbit/s, > 0: one for all (e.g. simulate.link_gbps=0.1, 100 "
            "Mbit/s), one per node (simulate.link_gbps=[1,1,1,0.05]), or null",
        )
        require(
            _numbers(latency, lambda v: v >= 0),
            "link_latency_ms",
            latency,
            "one-way milliseconds per round of an operation that crosses a node boundary, >= 0: one for "
            "all (e.g. 0.05) or one per node (simulate.link_latency_ms=[1,1,1,40])",
        )
        self.check_events()

    def check_events(self) -> None:
        """Each link event names a node, a start >= 0, a length > 0 and a speed > 0 (or null: down).

        Events need links."""
        example = "e.g. simulate.link_events=[{node:1,at_s:10,for_s:20,gbps:0.01}]"
        for i, e in enumerate(self.link_events):
            key = f"link_events[{i}]"
            require(e.node >= 0, f"{key}.node", e.node, f"an emulated node, >= 0 ({example})")
            require(_numbers(e.at_s, lambda v: v >= 0), f"{key}.at_s", e.at_s, "seconds of the job, >= 0")
            require(_numbers(e.for_s, lambda v: v > 0), f"{key}.for_s", e.for_s, "its length in seconds, > 0")
            require(
                e.gbps is None or _numbers(e.gbps, lambda v: v > 0),
                f"{key}.gbps",
                e.gbps,
                "the link's Gbit/s during the event, > 0, or null: the link is down (what crosses it waits)",
            )
        spans = sorted((e.node, e.at_s, e.at_s + e.for_s, i) for i, e in enumerate(self.link_events))
        for (node, _, end, _), (other, start, _, i) in zip(spans, spans[1:], strict=False):
            require(
                node != other or start >= end,
                f"link_events[{i}].at_s",
                start,
                f"node {node}'s event before it lasts until {end:g} s, and one node's events may not "
                f"overlap: start it at {end:g} or later",
            )
        require(
            not self.link_events or self.links(),
            "link_events",
            f"{len(self.link_events)} event(s)",
            "events change emulated links, and there are none: set simulate.ranks_per_node and "
            "simulate.link_gbps (or network=...), or drop the events",
        )

    def per_node(self, key: str, scale: float = 1.0) -> float | tuple[float, ...]:
        """The value of ``key`` (times ``scale``) as :class:`runner.comm.links.Links` takes it.

        ``key``: ``link_gbps`` or ``link_latency_ms``. A number, or a tuple of one per node."""
        value = getattr(self, key)
        if isinstance(value, (list, tuple)):
            return tuple(float(v) * scale for v in value)
        return float(value) * scale

    def links(self) -> bool:
        """Whether links between emulated nodes are emulated (both ``ranks_per_node`` and ``link_gbps``)."""
        return bool(self.ranks_per_node) and self.link_gbps is not None

    def delay_s(self, rank: int) -> float:
        """Seconds that worker ``rank`` sleeps per training step."""
        straggler = self.straggler_ms if rank in self.straggler_ranks else 0.0
        return (straggler + self.jitter_ms * random.Random(rank).random()) / 1e3

    def record(self) -> dict[str, Any] | None:
        """summary.json's ``straggler``: the ranks slowed down and the delay (and the jitter).

        None when no rank is."""
        slowed = bool(self.straggler_ranks and self.straggler_ms)
        if not slowed and not self.jitter_ms:
            return None
        record = {"ranks": list(self.straggler_ranks), "ms": self.straggler_ms} if slowed else {}
        record |= {"jitter_ms": self.jitter_ms} if self.jitter_ms else {}
        return record | ({"spin": True} if self.spin else {})

    def check_devices(self, devices: int, servers: int) -> None:
        """Only worker ranks may straggle: ``0 .. devices-1`` (the ``servers`` ranks after them serve)."""
        served = ""
        if servers == 1:
            served = f"; rank {devices} is the rule's server"
        elif servers > 1:
            served = f"; ranks {devices}..{devices + servers - 1} are the rule's servers"
        require(
            all(0 <= r < devices for r in self.straggler_ranks),
            "straggler_ranks",
            self.straggler_ranks,
            f"only workers may straggle: name ranks in 0..{devices - 1} (devices={devices}){served}",
        )
        ranks = devices + servers
        if self.links():
            nodes = -(-ranks // (self.ranks_per_node or 1))
            self._check_lists(nodes, ranks, servers)
            for i, e in enumerate(self.link_events):
                require(
                    e.node < nodes,
                    f"link_events[{i}].node",
                    e.node,
                    f"the job's {ranks} ranks make {nodes} emulated node(s), 0..{nodes - 1}",
                )
        require(
            not self.links() or (self.ranks_per_node or 0) < ranks,
            "ranks_per_node",
            self.ranks_per_node,
            f"it puts all {ranks} ranks on one emulated node, so no link is crossed: give a node fewer "
            "ranks (e.g. simulate.ranks_per_node=1, a node per rank), or simulate.link_gbps=null: no links",
        )

    def _check_lists(self, nodes: int, ranks: int, servers: int) -> None:
        """A list of one value per node names no node the job lacks."""
        served = f" (its {servers} server rank(s) after the workers included)" if servers else ""
        for key in ("link_gbps", "link_latency_ms"):
            value = getattr(self, key)
            require(
                not isinstance(value, (list, tuple)) or len(value) <= nodes,
                key,
                value,
                f"{len(value) if isinstance(value, (list, tuple)) else 1} values, one per emulated node, "
                f"but the job's {ranks} ranks{served} make {nodes} nodes of simulate.ranks_per_node="
                f"{self.ranks_per_node}: give at most {nodes} (a node past the list takes its last value)",
            )

    def warning(self) -> str | None:
        """What to tell about a setting that slows no rank although half of it is given."""
        if self.straggler_ranks and not self.straggler_ms:
            return (
                f"simulate.straggler_ranks={self.straggler_ranks} with simulate.straggler_ms=0: no rank is "
                "slowed down (set e.g. simulate.straggler_ms=30)"
            )
        if self.straggler_ms and not self.straggler_ranks:
            return (
                f"simulate.straggler_ms={self.straggler_ms:g} with no simulate.straggler_ranks: no rank is "
                "slowed down (set e.g. simulate.straggler_ranks=[1])"
            )
        if self.ranks_per_node and self.link_gbps is None:
            return (
                f"simulate.ranks_per_node={self.ranks_per_node} with no simulate.link_gbps: no link is "
                "emulated (set e.g. simulate.link_gbps=0.1)"
            )
        if self.link_gbps is not None and not self.ranks_per_node:
            return (
                f"simulate.link_gbps={_shown(self.link_gbps)} with no simulate.ranks_per_node: the ranks are "
                "on no emulated nodes, no link is emulated (set e.g. simulate.ranks_per_node=1)"
            )
        return None
