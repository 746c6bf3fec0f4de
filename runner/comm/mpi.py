"""``Comm``: one MPI communicator, behind which tensors take the first route that takes them.

Everything here works on torch tensors through zero-copy numpy views of contiguous CPU tensors and uses
mpi4py's buffer API (upper-case methods); the pickle API is kept for small Python objects (metrics,
configuration). A tensor collective walks the ordered routes of :mod:`runner.comm.routes` (the 16-bit
exchange, the ``torch.distributed`` transport, the background thread, MPI directly or staged); every call
maps MPI's failure errors to :class:`PeerLost` (:mod:`runner.comm.errors`) and accounts the bytes it sent and
the seconds it spent (:mod:`runner.comm.stats`), so the training loop can split a step into compute and
communication, and spends the seconds of the emulated links it crosses (:mod:`runner.comm.links`). The
rest of the layer, in modules of its own: the one-sided counter (:mod:`runner.comm.counter`), membership
and growth under ULFM (:mod:`runner.comm.membership`), pending requests (:mod:`runner.comm.requests`); the
names below are kept importable from here.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from runner.comm.background import Background
from runner.comm.binding import ANY_SOURCE, ANY_TAG, MPI, OPS, versions
from runner.comm.call import Call, communication
from runner.comm.counter import SERVING, Counter, FileCounter, ServedCounter
from runner.comm.errors import PeerLost, faulted, faults
from runner.comm.membership import GROWN_KEY, SERVER_KEY, Membership
from runner.comm.requests import BackgroundRequest, DistRequest, Request, progress, wait_all
from runner.comm.routes import choose as choose_route
from runner.comm.routes import load as load_routes
from runner.comm.routes.base import Route
from runner.comm.staging import Buffers, cuda_aware_mpi
from runner.comm.stats import CommStats, Transfer, clock, outermost, owe, share, tally

if TYPE_CHECKING:
    from runner.comm.face import EncodingLike

R = TypeVar("R", bound=Route)

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "GROWN_KEY",
    "SERVER_KEY",
    "BackgroundRequest",
    "Comm",
    "CommStats",
    "Counter",
    "DistRequest",
    "PeerLost",
    "Request",
    "abort",
    "finalize",
    "init",
    "join",
    "progress",
    "versions",
    "wait_all",
]


class Comm(Membership):
    """A thin wrapper over one MPI communicator, with byte and time accounting.

    ``Comm()`` wraps ``MPI.COMM_WORLD``; with a single process every collective is the identity. CUDA
    tensors go to MPI as they are when the library is CUDA-aware (``cuda_aware``, detected by default) and
    through pinned host buffers otherwise; non-contiguous tensors through a contiguous copy. Its members
    change under ULFM (:class:`~runner.comm.membership.Membership`).
    """

    def __init__(self, mpi_comm: Any = None, cuda_aware: bool | None = None, stats: CommStats | None = None):
        assert MPI.Is_initialized(), "call runner.comm.init() first"
        self._c = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.cuda_aware = cuda_aware_mpi() if cuda_aware is None else cuda_aware
        self.buffers = Buffers(self.cuda_aware)  # what MPI is given for each tensor
        self.host_buffers = self.buffers.host
        self.routes_tried = load_routes()  # the routes of runner/comm/routes, in order
        self.rank: int = self._c.Get_rank()
        self.size: int = self._c.Get_size()
        self.stats = stats if stats is not None else CommStats()
        self._background: Background | None = None
        self._node_comm: Any = None
        self._children: list[Comm] = []
        self.tolerant = False  # peers may die (return_errors): every MPI error raises PeerLost
        self.ids: list[int] | None = None  # each rank's id in the job, once processes were spawned into it
        self.grown = False  # processes were spawned into it (then MPI_Finalize is not called at the end)
        self.dist: Any = None  # the torch.distributed transport (runner/comm/dist.py), once attached
        self._nodes_of: Any = None  # what ``_nodes`` was computed for: (MPI communicator, links)
        self._node_list: list[int] = []

    def _collective(self, op: str, tensors: tuple[torch.Tensor, ...], *args: Any, **accounting: Any) -> Any:
        """Collective ``op`` of ``tensors`` by the first route that takes it.

        ``args``: the rest of its arguments; ``accounting``: ``wire`` (bytes counted by the 16-bit exchange's
        own steps) and ``root``."""
        wire = accounting.get("wire")
        factor = 0.0 if wire is not None else share(op, self.size, accounting.get("root") == self.rank)
        route = self.route_for(op, tensors, wire)
        with Call(self, op):
            result = getattr(route, op)(self, *tensors, *args)
            if self.stats.links is not None and outermost():
                self._spend(op, tensors[0], wire, result)
        if factor:
            self.stats.sent(tensors[0], factor)
        return result

    def _spend(self, op: str, t: torch.Tensor, wire: torch.dtype | None, result: Any) -> None:
        """Spend the emulated link seconds of collective ``op`` of ``t`` (in ``wire``'s type).

        They are owed by a blocking call, a transfer of the request of a non-blocking one
        (:mod:`runner.comm.stats`)."""
        links = self.stats.links
        assert links is not None
        itemsize = None if wire is None else wire.itemsize
        seconds = links.exchange(op, self._nodes(), t.numel(), t.element_size(), itemsize)
        if seconds and op in ("iallreduce", "allreduce_background"):
            result.transfer = Transfer(self.stats, seconds)
        else:
            owe(seconds)

    def _message(self, peer: int, t: torch.Tensor) -> float:
        """Emulated link seconds of a message of ``t`` to or from ``peer`` (0: no links, or the same node)."""
        links = self.stats.links
        if links is None:
            return 0.0
        nodes = self._nodes()
        return links.message(nodes[self.rank], nodes[peer], t.numel() * t.element_size())

    def _nodes(self) -> list[int]:
        """The emulated node of each rank of this communicator, in rank order (by its rank in the job)."""
        if self._nodes_of != (self._c, self.stats.links):
            links = self.stats.links
            assert links is not None
            self._node_list = [links.node(self.launch_rank(r)) for r in range(self.size)]
            self._nodes_of = (self._c, links)
        return self._node_list

    def route(self, kind: type[R]) -> R:
        """This communicator's own route object of class ``kind`` (to give it what it keeps for it)."""
        return next(r for r in self.routes_tried if isinstance(r, kind))

    def route_for(self, op: str, tensors: tuple[torch.Tensor, ...], wire: torch.dtype | None = None) -> Any:
        """The route that performs ``op`` of ``tensors`` (:mod:`runner.comm.routes`)."""
        return choose_route(self.routes_tried, self, op, tensors, wire)

    def keep(self, t: torch.Tensor) -> None:
        """Prepare the long-lived contiguous CPU buffer ``t`` once, for every later call on it.

        Meant for a gradient bucket: it saves the few microseconds of wrapping ``t`` for MPI on each call.
        ``t`` is kept alive with this communicator."""
        self.buffers.keep(t)

    # -- the torch.distributed transport -------------------------------------------------------------
    def use_transport(self, backend: str, timeout_s: float = 1800.0) -> None:
        """Collective: carry the collectives of ``backend``'s tensors on a ``torch.distributed`` group.

        ``nccl``: CUDA tensors, ``gloo``: CPU ones. The group is over this communicator's ranks; it follows
        the communicator when ranks are lost (:meth:`shrink`)."""
        from runner.comm.dist import Transport

        self.dist = Transport(self, backend, timeout_s)

    def routes(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s collectives travel on the ``torch.distributed`` transport."""
        return self.dist is not None and self.dist.takes(t)

    def await_work(self, work: Any) -> None:
        """Wait for a ``torch.distributed`` operation.

        Under fault tolerance it is polled between probes of MPI, so that a peer's death (which ULFM reports,
        or a survivor's revocation) raises :class:`PeerLost` here instead of leaving this rank waiting for the
        dead; an error of the backend raises it too."""
        with clock(self.stats):
            try:
                if self.tolerant:
                    pause = 1e-5
                    while not work.is_completed():
                        self.check_peers()
                        time.sleep(pause)
                        pause = min(2 * pause, 1e-3)
                work.wait()
            except RuntimeError as err:
                if isinstance(err, PeerLost) or not self.tolerant:
                    raise
                self.saw_loss = True
                raise PeerLost(f"{self.dist.backend}: {str(err).strip().splitlines()[0]}") from None

    # -- collectives (each by its route: runner/comm/routes) --------------------------------------------
    def allreduce(
        self,
        t: torch.Tensor,
        op: str = "sum",
        wire: torch.dtype | None = None,
        encoding: EncodingLike | None = None,
    ) -> torch.Tensor:
        """In-place allreduce of ``t`` (``op`` is sum, max or min); returns ``t``.

        ``wire``: a 16-bit type the sum travels in, accumulated in float32 (:mod:`runner.comm.wire`);
        ``encoding``: the sum's encoding, with its error feedback (:mod:`runner.comm.encodings`)."""
        if encoding is not None:
            assert op == "sum" and wire is None, (op, wire)
            with Call(self, "allreduce"):
                encoding.reduce(self, t)
                if self.stats.links is not None and outermost():
                    owe(encoding.seconds(self.stats.links, self._nodes(), t))
            return t
        self._collective("allreduce", (t,), op, wire, wire=wire)
        return t

    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request | DistRequest:
        """Start an in-place allreduce of ``t``; the result is valid after ``Request.wait``."""
        return self._collective("iallreduce", (t,), op)

    def allreduce_background(
        self,
        t: torch.Tensor,
        op: str = "sum",
        wire: torch.dtype | None = None,
        encoding: EncodingLike | None = None,
    ) -> BackgroundRequest | DistRequest:
        """Queue a blocking in-place allreduce of ``t`` on this communicator's background thread.

        Every rank must queue the same tensors in the same order (:mod:`runner.comm.background`); a tensor of
        the ``torch.distributed`` transport starts there instead. The time spent in ``wait`` is counted as
        communication time; the request holds the bytes sent for it (``sent``). ``wire`` and ``encoding``: as
        :meth:`allreduce`'s; an encoded sum of a transport's tensor is done at once (its all-to-all and
        all-gather queue on the transport)."""
        if encoding is not None and not self.routes(t):
            assert op == "sum" and wire is None, (op, wire)
            with Call(self, "allreduce_background"):
                request = self.background().submit(t, op, None, encoding)  # (the thread counts its bytes)
                if self.stats.links is not None and outermost():
                    seconds = encoding.seconds(self.stats.links, self._nodes(), t)
                    request.transfer = Transfer(self.stats, seconds) if seconds else None
            return request
        with tally() as here:  # the bytes this thread counts for it (the background thread's add to them)
            if encoding is None:
                request = self._collective("allreduce_background", (t,), op, wire, wire=wire)
            else:  # a transport's tensor
                self.allreduce(t, op, encoding=encoding)
                request = DistRequest(self, None)
        if isinstance(request, BackgroundRequest):
            request.caller_sent = here.bytes
        else:
            request.sent = here.bytes
        return request

    def background(self) -> Background:
        """This communicator's background thread (started on first use)."""
        if self._background is None:
            self._background = Background(self, self._reduce_queued)
        return self._background

    def end_background(self) -> None:
        """End the background thread once what is queued is done (without waiting for it)."""
        if self._background is not None:
            self._background.close()
            self._background = None

    def _reduce_queued(
        self, t: torch.Tensor, op: str, wire: torch.dtype | None, encoding: EncodingLike | None
    ) -> None:
        """A queued all-reduce, on the background thread.

        It runs by ``encoding``, or by the first route that performs a blocking one."""
        with faults(self, "allreduce"):
            if encoding is not None:
                encoding.reduce(self, t)
            else:
                self.route_for("allreduce", (t,), wire).allreduce(self, t, op, wire)

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast of ``t`` from ``root``; returns ``t``."""
        self._collective("broadcast", (t,), root, root=root)
        return t

    @faulted
    def barrier(self) -> None:
        """Wait until every rank has called it."""
        self._c.Barrier()

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Rank r's i-th of ``size`` equal chunks of ``send`` becomes chunk r of rank i's ``recv``."""
        self._collective("alltoall", (send, recv))

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Every rank's ``send``, in rank order, into each rank's ``recv`` (``size`` times as long)."""
        self._collective("allgather", (send, recv))

    # -- point to point (MPI's; ``wire``: a 16-bit type to send float tensors in) ------------------------
    @communication
    def send(self, t: torch.Tensor, dest: int, tag: int = 0, wire: torch.dtype | None = None) -> None:
        """Send ``t`` to ``dest`` (in ``wire``'s type, if given)."""
        t = t if wire is None else t.to(wire)
        self._c.Send(self.buffers.get(t)[0], dest=dest, tag=tag)
        self.stats.sent(t)
        owe(self._message(dest, t))

    @communication
    def isend(self, t: torch.Tensor, dest: int, tag: int = 0, wire: torch.dtype | None = None) -> Request:
        """Start sending ``t``; ``t`` must not change until the request completes.

        With ``wire``, a copy is sent and ``t`` is free at once."""
        t = t if wire is None else t.to(wire)
        buf, _ = self.buffers.get(t)
        request = Request(self, self._c.Isend(buf, dest=dest, tag=tag), None, buf)
        self.stats.sent(t)
        seconds = self._message(dest, t)
        if seconds and outermost():
            request.transfer = Transfer(self.stats, seconds)
        return request

    @communication
    def recv(
        self, t: torch.Tensor, source: int = ANY_SOURCE, tag: int = ANY_TAG, wire: torch.dtype | None = None
    ) -> tuple[int, int]:
        """Receive into ``t`` (sent in ``wire``'s type, if given); returns the message's ``(source, tag)``."""
        narrow = torch.empty(t.shape, dtype=wire) if wire is not None else None
        buf, staged = self.buffers.get(t if narrow is None else narrow, copy_in=False)
        status = MPI.Status()
        self._c.Recv(buf, source=source, tag=tag, status=status)
        if staged is not None:
            staged.finish()
        if narrow is not None:
            t.copy_(narrow)
        owe(self._message(status.Get_source(), t if narrow is None else narrow))
        return status.Get_source(), status.Get_tag()

    @communication
    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int] | None:
        """Non-blocking probe: ``(source, tag)`` of a waiting message, or None."""
        status = MPI.Status()
        found = self._c.Iprobe(source=source, tag=tag, status=status)
        return (status.Get_source(), status.Get_tag()) if found else None

    @communication
    def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int]:
        """Blocking probe: ``(source, tag)`` of the next matching message."""
        status = MPI.Status()
        self._c.Probe(source=source, tag=tag, status=status)
        return status.Get_source(), status.Get_tag()

    # -- small Python objects (pickled; not for tensors) --------------------------------------------
    @faulted
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        return self._c.allgather(obj)

    @faulted
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank."""
        return self._c.bcast(obj, root=root)

    @faulted
    def allreduce_values(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Allreduce a short list of floats (metrics) in float64."""
        arr = np.asarray(values, dtype=np.float64)
        self._c.Allreduce(MPI.IN_PLACE, arr, op=OPS[op])
        return arr.tolist()

    # -- structure --------------------------------------------------------------------------------
    @faulted
    def split(self, color: int, key: int | None = None, keep: bool = True) -> Comm:
        """A sub-communicator of the ranks that pass the same ``color`` (revoked with this one).

        ``keep`` False: a short-lived one, which the caller frees."""
        child = Comm(self._c.Split(color, self.rank if key is None else key), self.cuda_aware, self.stats)
        child.tolerant = self.tolerant
        if self.ids is not None:
            child.ids = child._c.allgather(self.launch_rank())
        if keep:
            self._children.append(child)
        return child

    def free(self) -> None:
        """Free a short-lived communicator (``split(keep=False)``)."""
        self._c.Free()

    def split_away(self, color: int, key: int) -> None:
        """Collective: take part in a split of this communicator and keep nothing of it."""
        self._c.Split(color, key).Free()

    def counter(self, slots: int = 1, host: int = 0) -> Counter | FileCounter | ServedCounter:
        """Collective: a :class:`Counter` of ``slots`` int64 values, all zero, held in ``host``'s memory.

        Across nodes a :class:`ServedCounter` (6-13× the calls a second of MPI's window there, and no dead
        rank holds it up); on one node MPI's window (``osc/sm``, 1-3 µs a call), or, when peers may die, a
        :class:`FileCounter` (the window would hang the survivors of a rank killed inside an update)."""
        with faults(self, "counter"):
            one_node = self.local_size() == self.size
        if one_node and self.tolerant:
            return FileCounter(self, slots, host)
        if not one_node and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            return ServedCounter(self, slots, host)
        return Counter(self, slots, host)

    def local_size(self) -> int:
        """Number of ranks of this communicator on this node."""
        return self._node().Get_size()

    def local_rank(self) -> int:
        """This rank's index among the ranks of this communicator on its node (any launcher)."""
        return self._node().Get_rank()

    def _node(self) -> Any:
        if self._node_comm is None:
            self._node_comm = self._c.Split_type(MPI.COMM_TYPE_SHARED)
        return self._node_comm


def init(cuda_aware: bool | None = None) -> Comm:
    """Initialise MPI (thread level MULTIPLE, for the communication thread) and return the world.

    Called once by each rank's worker; MPI is finalized at exit. A plain ``python`` process becomes a
    one-rank world (singleton init).
    """
    if not MPI.Is_initialized():
        provided = MPI.Init_thread(MPI.THREAD_MULTIPLE)
        assert provided >= MPI.THREAD_SERIALIZED, f"the MPI library gives thread level {provided} only"
        atexit.register(finalize)
    return Comm(cuda_aware=cuda_aware)


def join(first: int, cuda_aware: bool | None = None) -> Comm:
    """Initialise MPI in a spawned process and merge it into the job that spawned it; the job's world.

    The world is fault tolerant; in it the spawned processes have ids ``first``, ``first + 1``...."""
    world = init(cuda_aware)
    world.merge_parent(first)
    return world


def finalize() -> None:
    """End MPI in this process (once; also at exit).

    A counter's host thread, which calls MPI, ends first."""
    for counter in list(SERVING):
        counter.stop_serving()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def abort(status: int = 1) -> None:
    """End the whole job now (every rank): what a rank does when it fails, so that no peer waits forever."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(status)
