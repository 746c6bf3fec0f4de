"""Emulated links between nodes (``simulate.ranks_per_node``, ``simulate.link_gbps``, ``link_latency_ms``).

The job's ranks are grouped into emulated nodes by rank order (ranks ``0 .. r-1`` on node 0, ``r .. 2r-1``
on node 1...), each node with one link of ``gbps``. A collective or message that crosses a node boundary
costs ``steps × latency + bytes / bandwidth``: ``steps`` are the rounds its algorithm takes one after the
other, each paying the one-way latency (:func:`latency_steps`), and ``bytes`` what it moves over the busiest
node link it crosses (the slowest, as every link is as fast):

- all-reduce (a ring in rank order): 2(N-1)/N of the buffer on each ring edge that leaves a node;
- broadcast: the buffer once per receiving node, all of it out of the root's node;
- all-to-all (pairwise): a node of m ranks sends m(N-m)/N of each rank's buffer out;
- all-gather (a ring): N-1 times each rank's buffer on each ring edge that leaves a node;
- the 16-bit exchange's all-reduce (:mod:`runner.comm.wire`): its all-to-all and its all-gather, as they move;
- a point-to-point message: the message, if sender and receiver are on different nodes.

The algorithms are those the bytes above assume, for every size: an all-reduce over a ring pays 2(N−1)
latencies (a reduce-scatter and an all-gather of N−1 rounds each), an all-gather over a ring and a pairwise
all-to-all N−1, a binomial-tree broadcast ⌈log₂ N⌉, a message one. Open MPI's ``tuned`` component takes other
algorithms for small buffers (recursive doubling for a small all-reduce: ⌈log₂ N⌉ rounds of the whole buffer),
so the model overprices the latency of small all-reduces by up to 2(N−1)/⌈log₂ N⌉ (1.5× at N = 4; a DiLoCo or
BSP exchange of a model is large: ring). Nothing crosses when every rank of the communicator is on one node.
The communicator spends the seconds after the real operation (:mod:`runner.comm.stats`), where the real one on
this machine is nearly free.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.schema.sections import SimulateConfig

#: The all-reduces of ``Comm``, blocking and not.
ALLREDUCES = ("allreduce", "iallreduce", "allreduce_background")


@dataclass(frozen=True)
class Links:
    """Nodes of ``ranks_per_node`` ranks each, with links of ``gbps`` Gbit/s and ``latency_s`` per crossing
    operation; ``spin``: the wait is spent busy on the CPU instead of sleeping (``simulate.spin``)."""

    ranks_per_node: int
    gbps: float
    latency_s: float
    spin: bool = False

    def __post_init__(self) -> None:
        assert self.ranks_per_node >= 1 and self.gbps > 0 and self.latency_s >= 0, self

    def node(self, rank: int) -> int:
        """The emulated node of the job's ``rank``."""
        return rank // self.ranks_per_node

    def seconds(self, nbytes: float, steps: int = 1) -> float:
        """What moving ``nbytes`` over one link in ``steps`` rounds costs: a latency a round plus the
        transfer; nothing for no bytes."""
        return steps * self.latency_s + 8 * nbytes / (self.gbps * 1e9) if nbytes > 0 else 0.0

    def collective(self, op: str, nodes: Sequence[int], nbytes: int) -> float:
        """Seconds of collective ``op`` of a buffer of ``nbytes`` per rank over ranks on ``nodes`` (each
        rank's node, in the communicator's rank order)."""
        return self.seconds(crossing(op, nodes, nbytes), latency_steps(op, len(nodes)))

    def wire_allreduce(self, nodes: Sequence[int], numel: int, itemsize: int) -> float:
        """Seconds of the 16-bit exchange's all-reduce of ``numel`` values of ``itemsize`` bytes: an
        all-to-all of the padded buffer, then an all-gather of one chunk (:mod:`runner.comm.wire`)."""
        n = len(nodes)
        chunk = -(-numel // n) * itemsize
        return self.collective("alltoall", nodes, n * chunk) + self.collective("allgather", nodes, chunk)

    def exchange(self, op: str, nodes: Sequence[int], numel: int, itemsize: int, wire: int | None) -> float:
        """Seconds of collective ``op`` of ``numel`` values of ``itemsize`` bytes, or, with ``wire`` (a
        16-bit type's itemsize), of the 16-bit exchange's all-reduce of them: what a communicator spends
        and what a rule's background exchange owes, priced once."""
        if wire is not None:
            return self.wire_allreduce(nodes, numel, wire)
        return self.collective(op, nodes, numel * itemsize)

    def message(self, node: int, peer: int, nbytes: int) -> float:
        """Seconds of a point-to-point message of ``nbytes`` between ranks on nodes ``node`` and ``peer``."""
        return self.seconds(nbytes) if node != peer else 0.0


def crossing(op: str, nodes: Sequence[int], nbytes: int) -> float:
    """Bytes collective ``op`` of ``nbytes`` per rank moves over the busiest node link (0: none crossed)."""
    n, per_node = len(nodes), collections.Counter(nodes)
    if len(per_node) < 2:
        return 0.0
    if op in ALLREDUCES:
        return ring_edges(nodes) * 2 * (n - 1) / n * nbytes
    if op == "broadcast":
        return (len(per_node) - 1) * nbytes
    if op == "alltoall":
        return max(m * (n - m) for m in per_node.values()) / n * nbytes
    assert op == "allgather", op
    return ring_edges(nodes) * (n - 1) * nbytes


def latency_steps(op: str, n: int) -> int:
    """Rounds collective ``op`` takes over ``n`` ranks, one after the other (the module's docstring)."""
    if op in ALLREDUCES:
        return 2 * (n - 1)
    if op == "broadcast":
        return max(1, math.ceil(math.log2(n)))
    assert op in ("alltoall", "allgather"), op
    return n - 1


def ring_edges(nodes: Sequence[int]) -> int:
    """The most edges of the ring over ranks in order (rank i to i+1, the last to the first) that leave
    one node: 1 where each node's ranks are consecutive."""
    n = len(nodes)
    leaving = collections.Counter(nodes[i] for i in range(n) if nodes[i] != nodes[(i + 1) % n])
    return max(leaving.values(), default=0)


def emulated(simulate: SimulateConfig) -> Links | None:
    """The links ``simulate`` asks to emulate (``simulate.ranks_per_node`` and ``link_gbps``), or None."""
    if not simulate.links():
        return None
    assert simulate.ranks_per_node and simulate.link_gbps
    return Links(simulate.ranks_per_node, simulate.link_gbps, simulate.link_latency_ms / 1e3, simulate.spin)
