"""Emulated links between nodes (``simulate.ranks_per_node``, ``simulate.link_gbps``, ``link_latency_ms``).

The job's ranks are grouped into emulated nodes by rank order (ranks ``0 .. r-1`` on node 0, ``r .. 2r-1``
on node 1...), each node with a link of its own: the same ``gbps`` and latency for every node, or one
value per node (a node past the list, such as a rule's server or a worker that joined later, takes the
list's last value). A collective or message that crosses a node boundary costs ``steps × latency +``
the slowest node link's ``bytes / bandwidth``: ``steps`` are the rounds its algorithm takes one after the
other (:func:`latency_steps`), each paying the largest one-way latency of the nodes it spans (a round ends
when its slowest crossing ends), and each node's link carries its own share of the bytes
(:func:`link_bytes`), in each direction (a link is full duplex):

- all-reduce (a ring in rank order): 2(N-1)/N of the buffer on each ring edge that leaves the node;
- broadcast: all of it out of the root's node (rank 0's), once per receiving node; a receiving node once;
- all-to-all (pairwise): a node of m ranks sends m(N-m)/N of each rank's buffer out, and gets as much;
- all-gather (a ring): N-1 times each rank's buffer on each ring edge that leaves the node;
- the 16-bit exchange's all-reduce (:mod:`runner.comm.wire`): its all-to-all and its all-gather, as they move;
- a point-to-point message: the message over the slower of its two nodes' links, the larger latency.

The algorithms are those the bytes above assume, for every size: an all-reduce over a ring pays 2(N−1)
latencies (a reduce-scatter and an all-gather of N−1 rounds each), an all-gather over a ring and a pairwise
all-to-all N−1, a binomial-tree broadcast ⌈log₂ N⌉, a message one. Open MPI's ``tuned`` component takes other
algorithms for small buffers (recursive doubling for a small all-reduce: ⌈log₂ N⌉ rounds of the whole buffer),
so the model overprices the latency of small all-reduces by up to 2(N−1)/⌈log₂ N⌉ (1.5× at N = 4; a DiLoCo or
BSP exchange of a model is large: ring). Nothing crosses when every rank of the communicator is on one node.
The communicator spends the seconds after the real operation (:mod:`runner.comm.stats`), where the real one on
this machine is nearly free.

Links that change (``simulate.link_events``): during an event a node's link carries the event's Gbit/s, or,
with none, is down: what crosses it waits until it is back, then moves at its own rate. An event's times are
seconds of the job's clock, which starts as each rank begins its run, after its imports (within about a
second of its first step; a resumed job's and a joined worker's start anew).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

#: The all-reduces of ``Comm``, blocking and not.
ALLREDUCES = ("allreduce", "iallreduce", "allreduce_background")


class Event(NamedTuple):
    """Node ``node``'s link carries ``gbps`` (None: it is down) from ``at_s`` for ``for_s`` seconds."""

    node: int
    at_s: float
    for_s: float
    gbps: float | None = None

    def covers(self, node: int, now: float) -> bool:
        return node == self.node and self.at_s <= now < self.at_s + self.for_s


@dataclass(frozen=True)
class Links:
    """Nodes of ``ranks_per_node`` ranks, with links of ``gbps`` Gbit/s and ``latency_s`` per crossing round.

    One value for every node, or one per node. ``spin``: the wait is spent busy on the CPU instead of sleeping
    (``simulate.spin``)."""

    ranks_per_node: int
    gbps: float | tuple[float, ...]
    latency_s: float | tuple[float, ...]
    spin: bool = False
    events: tuple[Event, ...] = ()
    start: float = field(default_factory=time.monotonic, compare=False)  # the job's clock's zero

    def __post_init__(self) -> None:
        rates, latencies = _values(self.gbps), _values(self.latency_s)
        assert self.ranks_per_node >= 1 and rates and latencies, self
        assert min(rates) > 0 and min(latencies) >= 0, self

    def node(self, rank: int) -> int:
        """The emulated node of the job's ``rank``."""
        return rank // self.ranks_per_node

    def now(self) -> float:
        """Seconds of the job's clock (link events are timed on it)."""
        return time.monotonic() - self.start

    def event(self, node: int, now: float | None = None) -> Event | None:
        """The event node ``node``'s link is in at ``now`` (default: now), if any (the last one listed)."""
        if not self.events:
            return None
        now = self.now() if now is None else now
        return next((e for e in reversed(self.events) if e.covers(node, now)), None)

    def rate(self, node: int) -> float:
        """Node ``node``'s link in Gbit/s (during an event that slows it, the event's; down: its own)."""
        event = self.event(node)
        return event.gbps if event is not None and event.gbps is not None else _of(self.gbps, node)

    def down_for(self, nodes: Sequence[int]) -> float:
        """Seconds until every link of ``nodes`` is up (0: all are)."""
        now = self.now()
        waits = [e.at_s + e.for_s - now for n in nodes if (e := self.event(n, now)) and e.gbps is None]
        return max(waits, default=0.0)

    def edges(self, after: float, upto: float) -> Iterator[tuple[float, Event, bool]]:
        """``(time, event, began)`` of every event's start or end in ``(after, upto]``, in time order."""
        found = [(e.at_s, e, True) for e in self.events if after < e.at_s <= upto]
        found += [(e.at_s + e.for_s, e, False) for e in self.events if after < e.at_s + e.for_s <= upto]
        yield from sorted(found, key=lambda f: f[0])

    def latency(self, node: int) -> float:
        """Node ``node``'s one-way latency in seconds."""
        return _of(self.latency_s, node)

    def over(self, by_node: dict[int, float], steps: int, wait: bool = True) -> float:
        """Seconds of ``steps`` rounds that move ``by_node[n]`` bytes over node ``n``'s link (0: none).

        They come after the wait for a link that is down (``wait``: an operation's first part pays it,
        once)."""
        crossed = [n for n, b in by_node.items() if b > 0]
        if not crossed:
            return 0.0
        latency = max(self.latency(n) for n in by_node)
        down = self.down_for(crossed) if wait and self.events else 0.0
        return down + steps * latency + max(8 * by_node[n] / (self.rate(n) * 1e9) for n in crossed)

    def collective(self, op: str, nodes: Sequence[int], nbytes: int, wait: bool = True) -> float:
        """Seconds of collective ``op`` of a buffer of ``nbytes`` per rank over ranks on ``nodes``.

        ``nodes``: each rank's node, in the communicator's rank order."""
        return self.over(link_bytes(op, nodes, nbytes), latency_steps(op, len(nodes)), wait)

    def two_phase(self, nodes: Sequence[int], row: int) -> float:
        """Seconds of an all-reduce done as an all-to-all and an all-gather of one ``row`` of bytes per rank.

        As the 16-bit and the 8-bit exchanges do it; a down link is waited for once."""
        gather = self.collective("allgather", nodes, row, wait=False)
        return self.collective("alltoall", nodes, len(nodes) * row) + gather

    def wire_allreduce(self, nodes: Sequence[int], numel: int, itemsize: int) -> float:
        """Seconds of the 16-bit exchange's all-reduce of ``numel`` values of ``itemsize`` bytes.

        An all-to-all of the padded buffer, then an all-gather of one chunk (:mod:`runner.comm.wire`)."""
        return self.two_phase(nodes, -(-numel // len(nodes)) * itemsize)

    def exchange(self, op: str, nodes: Sequence[int], numel: int, itemsize: int, wire: int | None) -> float:
        """Seconds of collective ``op`` of ``numel`` values of ``itemsize`` bytes.

        With ``wire`` (a 16-bit type's itemsize), of the 16-bit exchange's all-reduce of them instead. What a
        communicator spends and what a rule's background exchange owes, priced once."""
        if wire is not None:
            return self.wire_allreduce(nodes, numel, wire)
        return self.collective(op, nodes, numel * itemsize)

    def message(self, node: int, peer: int, nbytes: int) -> float:
        """Seconds of a point-to-point message of ``nbytes`` between ranks on nodes ``node`` and ``peer``."""
        return self.over({node: nbytes, peer: nbytes}, 1) if node != peer else 0.0


def _values(value: float | tuple[float, ...]) -> tuple[float, ...]:
    return tuple(value) if isinstance(value, tuple) else (value,)


def _of(value: float | tuple[float, ...], node: int) -> float:
    """``value`` for ``node``: the one value, or the node's (past the list: its last)."""
    if not isinstance(value, tuple):
        return value
    return value[min(node, len(value) - 1)]


def link_bytes(op: str, nodes: Sequence[int], nbytes: int) -> dict[int, float]:
    """Bytes collective ``op`` of ``nbytes`` per rank moves over each node's link, each way.

    See the module's docstring. Every node of the communicator is named, 0 where nothing crosses."""
    n, per_node = len(nodes), collections.Counter(nodes)
    if len(per_node) < 2:
        return dict.fromkeys(per_node, 0.0)
    if op in ALLREDUCES or op == "allgather":
        per_edge = 2 * (n - 1) / n * nbytes if op in ALLREDUCES else (n - 1) * nbytes
        return {node: edges * per_edge for node, edges in leaving_edges(nodes).items()}
    if op == "broadcast":
        root = nodes[0]
        return {node: (len(per_node) - 1 if node == root else 1) * nbytes for node in per_node}
    assert op == "alltoall", op
    return {node: m * (n - m) / n * nbytes for node, m in per_node.items()}


def latency_steps(op: str, n: int) -> int:
    """Rounds collective ``op`` takes over ``n`` ranks, one after the other (the module's docstring)."""
    if op in ALLREDUCES:
        return 2 * (n - 1)
    if op == "broadcast":
        return max(1, math.ceil(math.log2(n)))
    assert op in ("alltoall", "allgather"), op
    return n - 1


def leaving_edges(nodes: Sequence[int]) -> dict[int, int]:
    """For each node, the edges of the ring over ranks in order that leave it.

    The ring goes from rank i to i+1, the last to the first."""
    n = len(nodes)
    leaving = collections.Counter(nodes[i] for i in range(n) if nodes[i] != nodes[(i + 1) % n])
    return {node: leaving.get(node, 0) for node in dict.fromkeys(nodes)}


class LinkSettings(Protocol):
    """What emulated links are built from (the config's ``simulate`` section)."""

    ranks_per_node: int | None
    link_gbps: Any
    link_events: Any
    spin: bool

    def links(self) -> bool: ...
    def per_node(self, key: str, scale: float = 1.0) -> float | tuple[float, ...]: ...


def emulated(simulate: LinkSettings) -> Links | None:
    """The links ``simulate`` asks to emulate (``simulate.ranks_per_node`` and ``link_gbps``), or None."""
    if not simulate.links():
        return None
    assert simulate.ranks_per_node and simulate.link_gbps is not None
    gbps, latency_s = simulate.per_node("link_gbps"), simulate.per_node("link_latency_ms", scale=1e-3)
    events = tuple(Event(e.node, e.at_s, e.for_s, e.gbps) for e in simulate.link_events)
    return Links(simulate.ranks_per_node, gbps, latency_s, simulate.spin, events)
