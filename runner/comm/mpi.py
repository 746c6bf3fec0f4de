"""The communication layer: the only module of mpitrain that imports mpi4py.

Everything here works on torch tensors through zero-copy numpy views of contiguous CPU tensors and uses
mpi4py's buffer API (upper-case methods); the pickle API is kept for small Python objects (metrics,
configuration). CUDA tensors are handed to MPI directly when the library is CUDA-aware and staged through
pinned host buffers otherwise; with a ``torch.distributed`` transport (:mod:`runner.comm.dist`, NCCL on
GPUs), the collectives of the tensors it carries go there instead. Every call accounts the bytes it sent
and the seconds it spent, so the training loop can split a step into compute and communication.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import mpi4py
import numpy as np
import torch

mpi4py.rc.initialize = False  # importing this module starts no MPI: the worker calls init() (data-loader
mpi4py.rc.finalize = False  # processes that import it never do); init() arranges the finalization

from mpi4py import MPI  # noqa: E402

from runner.comm.staging import HostBuffers, Staged, cuda_aware_mpi  # noqa: E402
from runner.comm.tags import WATCH  # noqa: E402
from runner.comm.wire import allreduce as wire_allreduce  # noqa: E402

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG
#: ULFM's error classes: a peer failed (75, 76 for a pending wildcard receive) or revoked the communicator.
_FAULTS = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
F = TypeVar("F", bound=Callable[..., Any])


class PeerLost(RuntimeError):
    """A process of the communicator died, or a survivor revoked the communicator after seeing one die.

    Raised by every communication call when the job runs with ``hardware.fault_tolerance=continue``
    (MPI's ULFM, errors returned instead of aborting); without it a lost process aborts the job in MPI.
    """


def _faults(fn: F) -> F:
    """Turn ULFM's failure errors of an MPI call into :class:`PeerLost`; under fault tolerance, any error
    (a collective cut short by a peer's death may fail with a generic class): the survivors' recovery
    then finds out whether a process was lost."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except MPI.Exception as err:
            comm = self if isinstance(self, Comm) else self._comm
            if err.Get_error_class() in _FAULTS or comm.tolerant:
                raise PeerLost(f"{fn.__name__}: {err.Get_error_string()}") from None
            raise

    return wrapper  # type: ignore[return-value]


def _view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with the contiguous CPU tensor ``t``."""
    assert t.is_contiguous() and t.device.type == "cpu", "comm buffers must be contiguous CPU tensors"
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: moved as 16-bit integers, never reduced
        t = t.view(torch.int16)
    return t.detach().numpy()


@dataclass
class CommStats:
    """Bytes this rank sent and seconds it spent in communication, over all of its communicators."""

    bytes_sent: int = 0
    seconds: float = 0.0


class Request:
    """A pending non-blocking operation; ``wait`` completes it (and copies staged data back).

    It holds the buffer until then, so a temporary tensor cannot be freed while MPI still uses it.
    """

    def __init__(self, comm: Comm, req: MPI.Request, staged: Staged | None, buffer: Any):
        self._comm, self._req, self._staged, self._buffer = comm, req, staged, buffer

    @_faults
    def test(self) -> bool:
        t0 = time.perf_counter()
        done = self._req.Test()
        self._comm.stats.seconds += time.perf_counter() - t0
        if done:
            self._complete()
        return done

    def _complete(self) -> None:
        if self._staged is not None:
            self._staged.finish()
        self._staged = self._buffer = None

    @_faults
    def wait(self) -> None:
        t0 = time.perf_counter()
        self._req.Wait()
        self._complete()
        self._comm.stats.seconds += time.perf_counter() - t0


class BackgroundRequest:
    """An all-reduce run by the communicator's background thread; ``wait`` blocks until it is done."""

    def __init__(self, comm: Comm):
        self._comm, self._done, self.error = comm, threading.Event(), None

    def test(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        t0 = time.perf_counter()
        self._done.wait()
        self._comm.stats.seconds += time.perf_counter() - t0
        if self.error is not None:
            raise self.error


class DistRequest:
    """A collective running on the ``torch.distributed`` transport; ``wait`` completes it (on a GPU it makes
    the current stream wait for it, without blocking the host)."""

    def __init__(self, comm: Comm, work: Any):
        self._comm, self._work = comm, work

    def test(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            self._comm.await_work(self._work)
            self._work = None


class Comm:
    """A thin wrapper over one MPI communicator, with byte and time accounting.

    ``Comm()`` wraps ``MPI.COMM_WORLD``; with a single process every collective is the identity. CUDA
    tensors go to MPI as they are when the library is CUDA-aware (``cuda_aware``, detected by default) and
    through pinned host buffers otherwise; non-contiguous tensors through a contiguous copy.
    """

    def __init__(self, mpi_comm: Any = None, cuda_aware: bool | None = None, stats: CommStats | None = None):
        assert MPI.Is_initialized(), "call runner.comm.init() first"
        self._c = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.cuda_aware = cuda_aware_mpi() if cuda_aware is None else cuda_aware
        self.host_buffers = HostBuffers()
        self.rank: int = self._c.Get_rank()
        self.size: int = self._c.Get_size()
        self.stats = stats if stats is not None else CommStats()
        self._thread: threading.Thread | None = None
        self._node_comm: Any = None
        self._children: list[Comm] = []
        self._ready: dict[int, tuple[torch.Tensor, Any]] = {}
        self.scratch: dict[Any, Any] = {}  # runner/comm/wire.py's 16-bit buffers
        self.tolerant = False  # peers may die (return_errors): every MPI error raises PeerLost
        self.ids: list[int] | None = None  # each rank's id in the job, once processes were spawned into it
        self.grown = False  # processes were spawned into it (then MPI_Finalize is not called at the end)
        self.dist: Any = None  # the torch.distributed transport (runner/comm/dist.py), once attached

    def _buffer(self, t: torch.Tensor, copy_in: bool = True) -> tuple[Any, Staged | None]:
        """What MPI is given for ``t``, and the staging to finish after the call (None: ``t`` itself).

        Work queued on the GPU is waited for first, since MPI reads and writes device memory outside
        CUDA's streams. A buffer given to :meth:`keep` is handed over as prepared then.
        """
        ready = self._ready.get(id(t))
        if ready is not None and ready[0] is t:
            return ready[1], None
        if t.is_contiguous() and t.device.type == "cpu":
            return _view(t), None
        if t.is_cuda and t.is_contiguous() and self.cuda_aware:
            torch.cuda.current_stream(t.device).synchronize()
            return t.detach(), None
        if t.is_cuda:
            host = self.host_buffers.get(t)
        else:
            host = torch.empty(t.numel(), dtype=t.dtype)
        staged = Staged(t, host, copy_in)
        return _view(host), staged

    def keep(self, t: torch.Tensor) -> None:
        """Prepare the long-lived contiguous CPU buffer ``t`` (a gradient bucket) once, for every later call
        on it: saves the few microseconds of wrapping it for MPI on each call. ``t`` is kept alive with this
        communicator."""
        if t.is_contiguous() and t.device.type == "cpu":
            self._ready[id(t)] = (t, _view(t))

    # -- the torch.distributed transport -------------------------------------------------------------
    def use_transport(self, backend: str, timeout_s: float = 1800.0) -> None:
        """Collective: carry the collectives of ``backend``'s tensors (``nccl``: CUDA, ``gloo``: CPU) on a
        ``torch.distributed`` group over this communicator's ranks; it follows the communicator when
        ranks are lost (:meth:`shrink`)."""
        from runner.comm.dist import Transport

        self.dist = Transport(self, backend, timeout_s)

    def routes(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s collectives travel on the ``torch.distributed`` transport."""
        return self.dist is not None and self.dist.takes(t)

    def await_work(self, work: Any) -> None:
        """Wait for a ``torch.distributed`` operation. Under fault tolerance it is polled between probes of
        MPI, so that a peer's death (which ULFM reports, or a survivor's revocation) raises
        :class:`PeerLost` here instead of leaving this rank waiting for the dead; an error of the backend
        raises it too."""
        t0 = time.perf_counter()
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
            raise PeerLost(f"{self.dist.backend}: {str(err).strip().splitlines()[0]}") from None
        finally:
            self.stats.seconds += time.perf_counter() - t0

    @_faults
    def check_peers(self) -> None:
        """Raise :class:`PeerLost` if ULFM knows a peer of this communicator died, or it was revoked."""
        self._c.Iprobe(source=MPI.ANY_SOURCE, tag=WATCH)

    # -- accounting -------------------------------------------------------------------------------
    def _sent(self, t: torch.Tensor, factor: float = 1.0) -> None:
        self.stats.bytes_sent += int(t.numel() * t.element_size() * factor)

    def _allreduce_bytes(self, t: torch.Tensor) -> None:
        """Bytes a bandwidth-optimal allreduce sends per rank: 2(N-1)/N of the buffer."""
        if self.size > 1:
            self._sent(t, 2 * (self.size - 1) / self.size)

    # -- collectives ------------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum", wire: torch.dtype | None = None) -> torch.Tensor:
        """In-place allreduce of ``t`` (``op`` is sum, max or min); returns ``t``. ``wire``: a 16-bit type
        the sum travels in, accumulated in float32 (:mod:`runner.comm.wire`)."""
        t0 = time.perf_counter()
        self._allreduce_now(t, op, wire)
        if wire is None:
            self._allreduce_bytes(t)
        self.stats.seconds += time.perf_counter() - t0
        return t

    @_faults
    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request | DistRequest:
        """Start an in-place allreduce of ``t``; the result is valid after ``Request.wait``."""
        t0 = time.perf_counter()
        self._allreduce_bytes(t)
        if self.routes(t):
            request: Request | DistRequest = DistRequest(self, self.dist.allreduce(t, op))
        else:
            buf, staged = self._buffer(t)
            request = Request(self, self._c.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op]), staged, buf)
        self.stats.seconds += time.perf_counter() - t0
        return request

    def allreduce_background(
        self, t: torch.Tensor, op: str = "sum", wire: torch.dtype | None = None
    ) -> BackgroundRequest | DistRequest:
        """Queue a blocking in-place allreduce of ``t`` on this communicator's background thread.

        Open MPI's non-blocking collectives progress only inside MPI calls and use slower algorithms; a
        thread running the blocking call overlaps truly (MPI_THREAD_MULTIPLE). Requests complete in order,
        and every rank must queue the same tensors in the same order. Only the time spent in ``wait`` is
        counted as communication time. A tensor of the ``torch.distributed`` transport needs no thread:
        its backend runs the all-reduce on a stream (NCCL) or threads (gloo) of its own.
        """
        if self.routes(t):
            if wire is not None:  # the 16-bit exchange's steps queue on the backend's stream (NCCL)
                self.allreduce(t, op, wire)
                return DistRequest(self, None)
            return self.iallreduce(t, op)
        if self._thread is None:
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name="mpitrain-comm", daemon=True)
            self._thread.start()
        request = BackgroundRequest(self)
        self._queue.put((t, op, wire, request))
        if wire is None:
            self._allreduce_bytes(t)
        return request

    def _serve(self) -> None:
        while True:
            t, op, wire, request = self._queue.get()
            try:
                if t is not None:
                    self._allreduce_now(t, op, wire)
            except BaseException as err:  # handed to the waiting thread
                request.error = err
            request._done.set()

    @_faults
    def _allreduce_now(self, t: torch.Tensor, op: str, wire: torch.dtype | None = None) -> None:
        """The all-reduce itself, in 16 bits when ``wire`` is given (its bytes counted by the all-to-all and
        the all-gather it is made of)."""
        if wire is not None and self.size > 1:
            assert op == "sum", "16-bit exchange sums"
            wire_allreduce(self, t, wire)
            return
        if self.routes(t):
            self.await_work(self.dist.allreduce(t, op))
            return
        buf, staged = self._buffer(t)
        self._c.Allreduce(MPI.IN_PLACE, buf, op=_OPS[op])
        if staged is not None:
            staged.finish()

    @_faults
    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast of ``t`` from ``root``; returns ``t``."""
        t0 = time.perf_counter()
        if self.routes(t):
            self.await_work(self.dist.broadcast(t, root))
        else:
            buf, staged = self._buffer(t)
            self._c.Bcast(buf, root=root)
            if staged is not None:
                staged.finish()
        if self.rank == root:
            self._sent(t, self.size - 1)
        self.stats.seconds += time.perf_counter() - t0
        return t

    @_faults
    def barrier(self) -> None:
        self._c.Barrier()

    @_faults
    def alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Rank r's i-th of ``size`` equal chunks of ``send`` becomes chunk r of rank i's ``recv``."""
        if self.routes(send) and self.routes(recv):
            self.await_work(self.dist.alltoall(send, recv))
        else:
            self._c.Alltoall(self._buffer(send)[0], self._buffer(recv, copy_in=False)[0])
        self._sent(send, (self.size - 1) / self.size)

    @_faults
    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Every rank's ``send``, in rank order, into each rank's ``recv`` (``size`` times as long)."""
        if self.routes(send) and self.routes(recv):
            self.await_work(self.dist.allgather(send, recv))
        else:
            self._c.Allgather(self._buffer(send)[0], self._buffer(recv, copy_in=False)[0])
        self._sent(send, self.size - 1)

    # -- point to point (``wire``: a 16-bit type to send float tensors in) ----------------------------
    @_faults
    def send(self, t: torch.Tensor, dest: int, tag: int = 0, wire: torch.dtype | None = None) -> None:
        t0 = time.perf_counter()
        if wire is not None:
            t = t.to(wire)
        buf, _ = self._buffer(t)
        self._c.Send(buf, dest=dest, tag=tag)
        self._sent(t)
        self.stats.seconds += time.perf_counter() - t0

    @_faults
    def isend(self, t: torch.Tensor, dest: int, tag: int = 0, wire: torch.dtype | None = None) -> Request:
        """Start sending ``t``; ``t`` must not change until the request completes (with ``wire``, a copy
        is sent and ``t`` is free at once)."""
        t0 = time.perf_counter()
        if wire is not None:
            t = t.to(wire)
        buf, _ = self._buffer(t)
        req = self._c.Isend(buf, dest=dest, tag=tag)
        self._sent(t)
        self.stats.seconds += time.perf_counter() - t0
        return Request(self, req, None, buf)

    @_faults
    def recv(
        self, t: torch.Tensor, source: int = ANY_SOURCE, tag: int = ANY_TAG, wire: torch.dtype | None = None
    ) -> tuple[int, int]:
        """Receive into ``t`` (sent in ``wire``'s type, if given); returns the message's ``(source, tag)``."""
        t0 = time.perf_counter()
        narrow = torch.empty(t.shape, dtype=wire) if wire is not None else None
        buf, staged = self._buffer(t if narrow is None else narrow, copy_in=False)
        status = MPI.Status()
        self._c.Recv(buf, source=source, tag=tag, status=status)
        if staged is not None:
            staged.finish()
        if narrow is not None:
            t.copy_(narrow)
        self.stats.seconds += time.perf_counter() - t0
        return status.Get_source(), status.Get_tag()

    @_faults
    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int] | None:
        """Non-blocking probe: ``(source, tag)`` of a waiting message, or None."""
        t0 = time.perf_counter()
        status = MPI.Status()
        found = self._c.Iprobe(source=source, tag=tag, status=status)
        self.stats.seconds += time.perf_counter() - t0
        return (status.Get_source(), status.Get_tag()) if found else None

    @_faults
    def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int]:
        """Blocking probe: ``(source, tag)`` of the next matching message."""
        t0 = time.perf_counter()
        status = MPI.Status()
        self._c.Probe(source=source, tag=tag, status=status)
        self.stats.seconds += time.perf_counter() - t0
        return status.Get_source(), status.Get_tag()

    # -- small Python objects (pickled; not for tensors) --------------------------------------------
    @_faults
    def allgather_object(self, obj: Any) -> list[Any]:
        return self._c.allgather(obj)

    @_faults
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._c.bcast(obj, root=root)

    @_faults
    def allreduce_values(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Allreduce a short list of floats (metrics) in float64."""
        arr = np.asarray(values, dtype=np.float64)
        self._c.Allreduce(MPI.IN_PLACE, arr, op=_OPS[op])
        return arr.tolist()

    # -- structure --------------------------------------------------------------------------------
    @_faults
    def split(self, color: int, key: int | None = None, keep: bool = True) -> Comm:
        """A sub-communicator of the ranks that pass the same ``color`` (revoked with this one; ``keep``
        False: a short-lived one, which the caller frees)."""
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

    def counter(self, slots: int = 1, host: int = 0) -> Counter:
        """Collective: a :class:`Counter` of ``slots`` int64 values, all zero, held in ``host``'s memory."""
        return Counter(self, slots, host)

    # -- fault tolerance (ULFM; hardware.fault_tolerance=continue) -----------------------------------------
    def return_errors(self) -> None:
        """Failures of peers raise :class:`PeerLost` instead of aborting the job (call before splitting:
        communicators made from this one inherit it)."""
        self._c.Set_errhandler(MPI.ERRORS_RETURN)
        self.tolerant = True

    def launch_rank(self, rank: int | None = None) -> int:
        """The rank in the job as launched (``MPI.COMM_WORLD``) of this communicator's ``rank``."""
        rank = self.rank if rank is None else rank
        if self.ids is not None:  # processes were spawned into it: they are in no common COMM_WORLD
            return self.ids[rank]
        return MPI.Group.Translate_ranks(self._c.Get_group(), [rank], MPI.COMM_WORLD.Get_group())[0]

    def revoke(self) -> None:
        """Revoke this communicator and those split from it: every survivor's pending and later calls on
        them raise :class:`PeerLost`, wherever it is, so all of them come to recover."""
        for comm in [self, *self._children]:
            try:
                comm._c.Revoke()
            except MPI.Exception:
                pass  # revoked already, by a peer

    def lost_peers(self) -> list[int]:
        """Acknowledge the failures this process knows of (so that wildcard receives go on among the
        living); the failed ranks, in this communicator."""
        self._c.Ack_failed()
        group = self._c.Get_failed()
        return MPI.Group.Translate_ranks(group, list(range(group.Get_size())), self._c.Get_group())

    def lost_peers_ids(self) -> list[int]:
        """:meth:`lost_peers`, as ids in the job (:meth:`launch_rank`)."""
        return [self.launch_rank(r) for r in self.lost_peers()]

    def shrink(self) -> list[int]:
        """Replace the communicator, in place, by one of its survivors (ranks renumbered in order); returns
        the lost ones' ranks as launched (:meth:`launch_rank`). Collective over the survivors. Split
        communicators are dropped: split anew. The background thread is idle first (its calls on the
        revoked communicator fail)."""
        if self._thread is not None:
            marker = BackgroundRequest(self)
            self._queue.put((None, None, None, marker))
            marker._done.wait()
        before = [self.launch_rank(r) for r in range(self.size)]
        mine = before[self.rank]
        self._replace(self._c.Shrink(), mine)
        after = set(self.ids)
        return [launched for launched in before if launched not in after]

    def _replace(self, new: Any, mine: int) -> None:
        """Make this object wrap ``new`` (this process's id in the job: ``mine``); split communicators
        are dropped (split anew)."""
        self._c = new
        if self.tolerant:
            self._c.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self._c.Get_rank(), self._c.Get_size()
        self.ids = self._c.allgather(mine)
        self._children, self._node_comm, self.scratch = [], None, {}
        if self.dist is not None:  # the transport's group follows: a new one over the new ranks
            self.dist.rebuild(self)

    def grow(self, argv: list[str], count: int, key: int, wdir: str) -> str | None:
        """Collective over this communicator (no lost ranks in it): start ``count`` processes running
        ``argv`` (``MPI_Comm_spawn``) and merge them in, in place; this process takes place ``key`` in
        the new order (the new ones take ``GROWN_KEY + i``). Returns why no process was started (MPI's
        message: no free slot, a command that failed), else None."""
        mine = self.launch_rank()
        info = MPI.Info.Create()
        info.Set("wdir", wdir)
        try:
            inter = self._c.Spawn(argv[0], argv[1:], maxprocs=count, info=info, root=0)
        except MPI.Exception as err:
            self.grown = True  # mpirun counts the failed spawn too
            return err.Get_error_string().strip()
        finally:
            info.Free()
        merged = inter.Merge(high=False)
        inter.Disconnect()  # (left connected, MPI_Finalize was seen to crash disconnecting it)
        self._replace(merged.Split(0, key), mine)
        self.grown = True
        return None

    @_faults
    def resplit(self, parent: Comm, color: int) -> None:
        """Collective over ``parent``: wrap, in place, ``parent``'s ranks of the same ``color`` (after the
        job grew; ranks keep ``parent``'s order)."""
        self.tolerant = parent.tolerant
        self._replace(parent._c.Split(color, parent.rank), parent.launch_rank())
        if self not in parent._children:
            parent._children.append(self)

    def fault_barrier(self) -> list[int]:
        """A barrier that completes among the survivors when processes have died (``MPI_Comm_agree``),
        then shrinks the communicator if any had; returns the lost ones' ranks as launched."""
        while True:
            try:
                self._c.Agree(1)
                break
            except MPI.Exception as err:
                if err.Get_error_class() not in _FAULTS:
                    raise
                self.lost_peers()
        return self.shrink() if self.lost_peers() else []

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


class Counter:
    """Shared int64 values held by one rank (``host``) and updated by any rank with MPI's one-sided atomics.

    ``fetch_add`` is ``MPI_Fetch_and_op`` in a passive-target epoch that stays open for the counter's life:
    over shared memory (Open MPI's ``osc/sm``, one node) the origin updates the host's memory itself, so a
    host busy computing does not delay it (about 1-3 µs a call here). Across nodes the transport decides
    whether the host must enter MPI for the call to progress (benchmarks/README.md).
    """

    def __init__(self, comm: Comm, slots: int, host: int = 0):
        self._comm, self.host, self.slots = comm, host, slots
        self._win = MPI.Win.Allocate(8 * slots if comm.rank == host else 0, 8, comm=comm._c)
        if comm.rank == host:
            np.frombuffer(self._win.tomemory(), dtype=np.int64)[:] = 0
        self._win.Lock_all(MPI.MODE_NOCHECK)
        comm._c.Barrier()
        self._one = np.ones(1, dtype=np.int64)

    def fetch_add(self, slot: int = 0, value: int = 1) -> int:
        """Add ``value`` to ``slot`` atomically; the value it held before."""
        return self._fetch_and_op(slot, value, MPI.SUM)

    def fetch_max(self, slot: int, value: int) -> int:
        """Raise ``slot`` to ``value`` atomically (if it is lower); the value it held before."""
        return self._fetch_and_op(slot, value, MPI.MAX)

    @_faults
    def _fetch_and_op(self, slot: int, value: int, op: MPI.Op) -> int:
        self._one[0] = value
        out = np.zeros(1, dtype=np.int64)
        self._win.Fetch_and_op(self._one, out, self.host, slot, op)
        self._win.Flush(self.host)
        return int(out[0])

    @_faults
    def put(self, slot: int, values: Sequence[int]) -> None:
        """Replace ``slot`` and the slots after it by ``values``, each atomically."""
        data = np.asarray(values, dtype=np.int64)
        self._win.Accumulate(data, self.host, (slot, len(data), MPI.INT64_T), MPI.REPLACE)
        self._win.Flush(self.host)

    @_faults
    def read(self, slot: int = 0, count: int = 1) -> list[int]:
        """``count`` values from ``slot`` on, each read atomically."""
        out = np.zeros(count, dtype=np.int64)
        self._win.Get_accumulate(
            np.zeros(count, dtype=np.int64), out, self.host, (slot, count, MPI.INT64_T), MPI.NO_OP
        )
        self._win.Flush(self.host)
        return out.tolist()

    def snapshot(self) -> list[int]:
        """The host only: every slot, read from its own memory (works when other ranks were lost)."""
        assert self._comm.rank == self.host, "only the counter's host holds its slots"
        return np.frombuffer(self._win.tomemory(), dtype=np.int64).tolist()

    def close(self) -> None:
        """Collective: end the access epoch and free the window. After a peer was lost, the window is
        dropped instead (freeing it would wait for the dead)."""
        if self._win is None:
            return
        try:
            self._win.Unlock_all()
            if not self._comm.tolerant:
                self._win.Free()
        except MPI.Exception:
            pass  # a lost peer: the survivors make a new counter
        self._win = None


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


#: The order keys of a job's ranks after it grew (:meth:`Comm.grow`): its workers by rank, then the spawned
#: ones, then its servers.
GROWN_KEY = 1 << 20
SERVER_KEY = 1 << 21


def join(first: int, cuda_aware: bool | None = None) -> Comm:
    """Initialise MPI in a spawned process and merge it into the job that spawned it: the job's world
    (fault tolerant), in which the spawned processes have ids ``first``, ``first + 1``...."""
    init(cuda_aware)
    mine = first + MPI.COMM_WORLD.Get_rank()
    parent = MPI.Comm.Get_parent()
    merged = parent.Merge(high=True)
    parent.Disconnect()
    world = Comm(MPI.COMM_WORLD, cuda_aware)
    world.return_errors()
    order = GROWN_KEY + MPI.COMM_WORLD.Get_rank()
    world._replace(merged.Split(0, order), mine)
    world.grown = True
    return world


def finalize() -> None:
    """End MPI in this process (once; also at exit)."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def abort(status: int = 1) -> None:
    """End the whole job now (every rank): what a rank does when it fails, so that no peer waits forever."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(status)


def versions() -> dict[str, str]:
    """The versions of mpi4py and of the MPI library this process runs with."""
    library = MPI.Get_library_version().replace("\0", "").strip()  # Open MPI's ends with a NUL
    return {"mpi4py": mpi4py.__version__, "mpi": library.splitlines()[0]}


def wait_all(requests: Sequence[Request]) -> None:
    for r in requests:
        r.wait()


def progress(requests: Sequence[Request]) -> None:
    """Drive pending non-blocking operations forward (MPI progresses only inside MPI calls)."""
    for r in requests:
        r.test()
