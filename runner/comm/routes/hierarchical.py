"""The hierarchical exchange (``hardware.hierarchical``): an all-reduce across hosts via one leader per host.

An all-reduce over ranks on several hosts, several on some, is done as a reduce to one leader inside each host
(shared memory), an all-reduce among the leaders, and a broadcast inside each host.

A host's link then carries the buffer once each way (``2(k-1)/k`` of it over ``k`` hosts), the least any
all-reduce moves across it, against ``3/2`` for a ring over 2 hosts of 2 ranks and 2 for recursive
doubling. Between two hosts the leaders swap their sums in segments, both ways at once. Tried and measured
slower on the test nodes (benchmarks/README.md, "Hierarchical exchange"): a reduce-scatter inside the host
and the shards all-reduced in parallel by every rank (each host's link carries as much, in more flows).

The sub-communicators are made once, collectively, by :func:`settle` when the rank starts, and kept by the
communicator's own :class:`Hierarchical` route; a communicator whose members may change (fault tolerance),
whose tensors travel on ``torch.distributed``, or whose links are emulated (``simulate.ranks_per_node``: those
price the flat ring) never takes this route, and ``auto`` leaves the exchange to MPI where MPI's own is
hierarchical (Open MPI 5's coll/han). It performs the blocking all-reduce of float32 and float64 CPU tensors
(CUDA ones staged through host memory without CUDA-aware MPI); the background thread's queued all-reduces come
here too (it runs blocking ones); the non-blocking ``iallreduce`` stays flat (docs/hardware.md, "Hierarchical
exchange"). The bytes counted for it are the flat all-reduce's ``2(N-1)/N`` of the buffer per rank
(:mod:`runner.comm.stats`): the leaders send more, the others less.

"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runner.comm.binding import MPI, OPS
from runner.comm.routes.base import Carrier, Route

if TYPE_CHECKING:
    from runner.comm.mpi import Comm

#: The element types it reduces, as MPI's.
DTYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}
#: Values per message between two hosts (1 MB of float32).
SEGMENT = 1 << 18
#: Each operation as numpy combines two parts (between two hosts).
COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@dataclass
class Hosts:
    """How a communicator's ranks sit on hosts, and the sub-communicators of the exchange.

    ``node`` (this host's ranks), ``across`` (the hosts' leaders, None on the others); ``mpi``: the
    communicator they were made from."""

    mpi: Any
    sizes: list[int]  # ranks per host, by host
    node: Any
    across: Any
    kept: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)  # receive buffers

    @property
    def applies(self) -> bool:
        """Whether the exchange differs from the flat one: several hosts, several ranks on some."""
        return len(self.sizes) > 1 and max(self.sizes) > 1

    def free(self) -> None:
        """Free the sub-communicators (collective over the communicator they were made from)."""
        for sub in (self.node, self.across):
            if sub is not None:
                sub.Free()

    def describe(self) -> str:
        """The hosts in one phrase, e.g. ``2 hosts x 2 ranks``, ``one host``."""
        if len(self.sizes) == 1:
            return "one host"
        if len(set(self.sizes)) == 1:
            return f"{len(self.sizes)} hosts x {self.sizes[0]} rank{'s' * (self.sizes[0] > 1)}"
        return f"{len(self.sizes)} hosts of {'+'.join(map(str, self.sizes))} ranks"


def why_not(comm: Comm) -> str | None:
    """Why the exchange cannot run on ``comm`` (before asking where its ranks are), or None."""
    if comm.tolerant:
        return "its members may change (hardware.fault_tolerance): the sub-communicators would go stale"
    if comm.dist is not None:
        return f"its tensors travel on torch.distributed ({comm.dist.backend}; hardware.transport)"
    if comm.stats.links is not None:
        return "its links are emulated (simulate.ranks_per_node), which price the flat ring"
    return None


def library_does_it(environ: dict[str, str] | None = None, library: str | None = None) -> str | None:
    """Why MPI's own all-reduce across hosts is hierarchical already, or None.

    Open MPI 5 selects coll/han for communicators that span nodes (its priority 35 above coll/tuned's 30)
    unless the job's MCA options (``hardware.mca``, which reach the ranks as ``OMPI_MCA_*``) exclude it or
    lower its priority."""
    env = os.environ if environ is None else environ
    library = MPI.Get_library_version() if library is None else library
    version = re.search(r"Open MPI v(\d+)", library)
    if version is None or int(version.group(1)) < 5:
        return None
    coll = env.get("OMPI_MCA_coll", "").replace(" ", "")
    if coll.startswith("^") and "han" in coll[1:].split(","):
        return None
    if coll and not coll.startswith("^") and "han" not in coll.split(","):
        return None
    if int(env.get("OMPI_MCA_coll_han_priority", 35)) <= int(env.get("OMPI_MCA_coll_tuned_priority", 30)):
        return None
    return (
        f"Open MPI {version.group(1)}'s coll/han does it (hardware.mca.coll='^han' leaves it to this route)"
    )


def settle(comm: Comm, mode: str, host: int | None = None) -> str:
    """Collective over ``comm``: whether its all-reduces take the hierarchical route.

    ``mode``: auto, on or off, as ``hardware.hierarchical`` declares and checks them; ``auto`` leaves the
    exchange to MPI where MPI's own is hierarchical (:func:`library_does_it`). Returns ``on``, ``off`` or
    ``mpi`` (MPI's own), recorded in the run's versions; ``on`` that cannot apply raises ValueError.
    ``host``: this rank's host as a number (default: the ranks that share memory are a host)."""
    if mode == "off" or comm.size == 1:
        why = None if mode == "off" else "the job has one worker"
    else:
        why = why_not(comm)
    hosts = None
    if why is None and mode != "off":
        hosts = split_hosts(comm, host)
        if not hosts.applies:
            why = f"the workers are on {hosts.describe()}: nothing to gather inside a host before crossing"
    library = library_does_it() if mode == "auto" and why is None else None
    if hosts is not None and (why is not None or library is not None):
        hosts.free()
    if library is not None:
        if comm.rank == 0:
            print(f"hierarchical exchange: MPI's own ({library})")
        return "mpi"
    if why is not None and mode == "on":
        raise ValueError(
            f"hardware.hierarchical=on: {why}; the exchange needs workers on several hosts, several on "
            "some, and a fixed membership: use hardware.hierarchical=auto (or off)"
        )
    if hosts is None or why is not None:
        return "off"
    comm.route(Hierarchical).hosts = hosts
    if comm.rank == 0:
        print(f"hierarchical exchange: {hosts.describe()}, one leader per host")
    return "on"


def split_hosts(comm: Comm, host: int | None = None) -> Hosts:
    """Collective: ``comm``'s ranks by host and the sub-communicators.

    ``host``: this rank's host as a number (default: MPI's shared-memory split, one node's ranks)."""
    if host is None:
        node = comm._c.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    else:
        node = comm._c.Split(host, comm.rank)
    leader = node.Get_rank() == 0
    sizes = [s for s, first in comm._c.allgather((node.Get_size(), leader)) if first]
    across = comm._c.Split(0 if leader else MPI.UNDEFINED, comm.rank)
    return Hosts(comm._c, sizes, node, None if across == MPI.COMM_NULL else across)


class Hierarchical(Route):
    """Blocking all-reduces of float tensors on a communicator :func:`settle` set the exchange on.

    :func:`settle` gave this, the communicator's own route, the :class:`Hosts`."""

    def __init__(self) -> None:
        self.hosts: Hosts | None = None

    def takes(
        self, comm: Carrier, op: str, tensors: tuple[torch.Tensor, ...], wire: torch.dtype | None
    ) -> bool:
        hosts = self.hosts
        if hosts is None or wire is not None or hosts.mpi is not comm._c:
            return False
        t = tensors[0]
        return t.dtype in DTYPES and (t.device.type == "cpu" or not comm.buffers.cuda_aware)

    def allreduce(self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None) -> None:
        hosts = self.hosts
        assert hosts is not None, "taken only once settled"
        buf, staged = comm.buffers.get(t)
        if hosts.node.Get_rank() == 0:
            hosts.node.Reduce(MPI.IN_PLACE, buf, op=OPS[op], root=0)
            _across(hosts, buf, t.dtype, op)
        else:
            hosts.node.Reduce(buf, None, op=OPS[op], root=0)
        hosts.node.Bcast(buf, root=0)
        if staged is not None:
            staged.finish()


def _received(hosts: Hosts, numel: int, dtype: torch.dtype) -> np.ndarray:
    """The buffer a leader receives ``numel`` values into from the other host, kept from call to call."""
    kept = hosts.kept.get((numel, dtype))
    if kept is None:
        kept = hosts.kept[(numel, dtype)] = torch.empty(numel, dtype=dtype)
    return kept.numpy()


def _across(hosts: Hosts, part: np.ndarray, dtype: torch.dtype, op: str) -> None:
    """All-reduce ``part`` across the hosts.

    Between two, each sends its part to the other in segments of :data:`SEGMENT` values, all posted at once,
    and combines (``a + b`` is ``b + a``: both get the same bits). Over a 100 Mbit/s link Open MPI's
    all-reduce of two ranks sent one way and then back (twice the time), and one whole-buffer exchange took
    twice as long one time in three (benchmarks/hierarchical.py)."""
    if hosts.across.Get_size() != 2:
        hosts.across.Allreduce(MPI.IN_PLACE, part, op=OPS[op])
        return
    theirs = _received(hosts, part.size, dtype)
    peer = 1 - hosts.across.Get_rank()
    requests = []
    for start in range(0, part.size, SEGMENT):
        requests.append(hosts.across.Irecv(theirs[start : start + SEGMENT], source=peer))
        requests.append(hosts.across.Isend(part[start : start + SEGMENT], dest=peer))
    MPI.Request.Waitall(requests)
    COMBINE[op](part, theirs, out=part)
