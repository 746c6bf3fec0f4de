"""The communication layer: the only module of mpitrain that imports mpi4py.

Everything here works on torch tensors through zero-copy numpy views of contiguous CPU tensors and uses
mpi4py's buffer API (upper-case methods); the pickle API is kept for small Python objects (metrics,
configuration). CUDA tensors are handed to MPI directly when the library is CUDA-aware and staged through
pinned host buffers otherwise. Every call accounts the bytes it sent and the seconds it spent, so the
training loop can split a step into compute and communication.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import mpi4py
import numpy as np
import torch

#: Set by the worker to its own pid. A process that imports this module under another pid (a data-loader
#: process started through multiprocessing's forkserver, which imports the rank's main module) must not
#: initialise MPI: it would join the job's shared-memory transport as a second copy of the rank.
OWNER_ENV = "MPITRAIN_MPI_PID"
if os.environ.get(OWNER_ENV, str(os.getpid())) != str(os.getpid()):
    mpi4py.rc.initialize = mpi4py.rc.finalize = False

from mpi4py import MPI  # noqa: E402

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG


def _view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with the contiguous CPU tensor ``t``."""
    assert t.is_contiguous() and t.device.type == "cpu", "comm buffers must be contiguous CPU tensors"
    return t.detach().numpy()


#: Overrides the detection of :func:`cuda_aware_mpi`: ``1`` or ``0`` (``hardware.cuda_aware`` reaches a
#: rank's Comm directly; this is for jobs started by hand, such as the comm tests).
CUDA_AWARE_ENV = "MPITRAIN_CUDA_AWARE"


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library this process has loaded (found in /proc/self/maps), to query its extensions."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({ln.split()[-1] for ln in maps if "/libmpi" in ln and ".so" in ln})
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def cuda_aware_mpi() -> bool:
    """Whether the loaded MPI library accepts CUDA device memory in its calls.

    ``MPITRAIN_CUDA_AWARE=0|1`` decides when set; otherwise Open MPI is asked through
    ``MPIX_Query_cuda_support()`` (built and available at run time) and MPICH through
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)``. Any other library counts as not CUDA-aware, so CUDA
    tensors are staged through host memory, which is always correct.
    """
    forced = os.environ.get(CUDA_AWARE_ENV)
    if forced is not None:
        return forced == "1"
    lib = _libmpi()
    if lib is None:
        return False
    if hasattr(lib, "MPIX_Query_cuda_support"):
        return bool(lib.MPIX_Query_cuda_support())
    if hasattr(lib, "MPIX_GPU_query_support"):
        supported = ctypes.c_int(0)
        return lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0 and bool(supported.value)
    return False


class _Staged:
    """A tensor MPI cannot read in place (on a GPU without CUDA-aware MPI, or not contiguous), staged
    through a contiguous host copy; ``finish`` copies the result back."""

    def __init__(self, t: torch.Tensor, host: torch.Tensor, copy_in: bool):
        self.tensor, self.host = t, host
        if copy_in:
            host.view(t.shape).copy_(t.detach(), non_blocking=t.is_cuda)
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()

    def finish(self) -> None:
        self.tensor.copy_(self.host.view(self.tensor.shape))


class _HostBuffers:
    """Pinned host buffers for staging CUDA tensors, one per device tensor, reused from call to call.

    Pinned (page-locked) memory makes the device-host copies direct DMA transfers; allocating it is slow,
    so the buffer of a tensor that is communicated every step (a BSP bucket, a flat parameter vector) is
    allocated once. At most ``capacity`` buffers are kept (least recently used dropped first); a buffer
    still in use by a pending request stays alive through that request.
    """

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._buffers: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self.allocated = 0

    def get(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.numel(), t.dtype)
        host = self._buffers.pop(key, None)
        if host is None:
            host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self.allocated += 1
            if len(self._buffers) >= self.capacity:
                self._buffers.pop(next(iter(self._buffers)))
        self._buffers[key] = host
        return host

    def __len__(self) -> int:
        return len(self._buffers)


class Request:
    """A pending non-blocking operation; ``wait`` completes it (and copies staged data back).

    It holds the buffer until then, so a temporary tensor cannot be freed while MPI still uses it.
    """

    def __init__(self, comm: Comm, req: MPI.Request, staged: _Staged | None, buffer: Any):
        self._comm, self._req, self._staged, self._buffer = comm, req, staged, buffer

    def test(self) -> bool:
        t0 = time.perf_counter()
        done = self._req.Test()
        self._comm.seconds += time.perf_counter() - t0
        if done:
            self._complete()
        return done

    def _complete(self) -> None:
        if self._staged is not None:
            self._staged.finish()
        self._staged = self._buffer = None

    def wait(self) -> None:
        t0 = time.perf_counter()
        self._req.Wait()
        self._complete()
        self._comm.seconds += time.perf_counter() - t0


class BackgroundRequest:
    """An all-reduce run by the communicator's background thread; ``wait`` blocks until it is done."""

    def __init__(self, comm: Comm):
        self._comm, self._done, self.error = comm, threading.Event(), None

    def test(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        t0 = time.perf_counter()
        self._done.wait()
        self._comm.seconds += time.perf_counter() - t0
        if self.error is not None:
            raise self.error


class Comm:
    """A thin wrapper over one MPI communicator, with byte and time accounting.

    ``Comm()`` wraps ``MPI.COMM_WORLD``; with a single process every collective is the identity. CUDA
    tensors go to MPI as they are when the library is CUDA-aware (``cuda_aware``, detected by default) and
    through pinned host buffers otherwise; non-contiguous tensors through a contiguous copy.
    """

    def __init__(self, mpi_comm: Any = None, cuda_aware: bool | None = None):
        self._c = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.cuda_aware = cuda_aware_mpi() if cuda_aware is None else cuda_aware
        self.host_buffers = _HostBuffers()
        self.rank: int = self._c.Get_rank()
        self.size: int = self._c.Get_size()
        self.bytes_sent = 0
        self.seconds = 0.0
        self._thread: threading.Thread | None = None
        self._node_comm: Any = None

    def _buffer(self, t: torch.Tensor, copy_in: bool = True) -> tuple[Any, _Staged | None]:
        """What MPI is given for ``t``, and the staging to finish after the call (None: ``t`` itself).

        Work queued on the GPU is waited for first, since MPI reads and writes device memory outside
        CUDA's streams.
        """
        if t.is_contiguous() and t.device.type == "cpu":
            return _view(t), None
        if t.is_cuda and t.is_contiguous() and self.cuda_aware:
            torch.cuda.current_stream(t.device).synchronize()
            return t.detach(), None
        if t.is_cuda:
            host = self.host_buffers.get(t)
        else:
            host = torch.empty(t.numel(), dtype=t.dtype)
        staged = _Staged(t, host, copy_in)
        return _view(host), staged

    # -- accounting -------------------------------------------------------------------------------
    def _sent(self, t: torch.Tensor, factor: float = 1.0) -> None:
        self.bytes_sent += int(t.numel() * t.element_size() * factor)

    def _allreduce_bytes(self, t: torch.Tensor) -> None:
        """Bytes a bandwidth-optimal allreduce sends per rank: 2(N-1)/N of the buffer."""
        if self.size > 1:
            self._sent(t, 2 * (self.size - 1) / self.size)

    # -- collectives ------------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce of ``t`` (``op`` is sum, max or min); returns ``t``."""
        t0 = time.perf_counter()
        buf, staged = self._buffer(t)
        self._c.Allreduce(MPI.IN_PLACE, buf, op=_OPS[op])
        if staged is not None:
            staged.finish()
        self._allreduce_bytes(t)
        self.seconds += time.perf_counter() - t0
        return t

    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request:
        """Start an in-place allreduce of ``t``; the result is valid after ``Request.wait``."""
        t0 = time.perf_counter()
        buf, staged = self._buffer(t)
        req = self._c.Iallreduce(MPI.IN_PLACE, buf, op=_OPS[op])
        self._allreduce_bytes(t)
        self.seconds += time.perf_counter() - t0
        return Request(self, req, staged, buf)

    def allreduce_background(self, t: torch.Tensor, op: str = "sum") -> BackgroundRequest:
        """Queue a blocking in-place allreduce of ``t`` on this communicator's background thread.

        Open MPI's non-blocking collectives progress only inside MPI calls and use slower algorithms; a
        thread running the blocking call overlaps truly (MPI_THREAD_MULTIPLE). Requests complete in order,
        and every rank must queue the same tensors in the same order. Only the time spent in ``wait`` is
        counted as communication time.
        """
        if self._thread is None:
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name="mpitrain-comm", daemon=True)
            self._thread.start()
        request = BackgroundRequest(self)
        self._queue.put((t, op, request))
        self._allreduce_bytes(t)
        return request

    def _serve(self) -> None:
        while True:
            t, op, request = self._queue.get()
            try:
                buf, staged = self._buffer(t)
                self._c.Allreduce(MPI.IN_PLACE, buf, op=_OPS[op])
                if staged is not None:
                    staged.finish()
            except BaseException as err:  # handed to the waiting thread
                request.error = err
            request._done.set()

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast of ``t`` from ``root``; returns ``t``."""
        t0 = time.perf_counter()
        buf, staged = self._buffer(t)
        self._c.Bcast(buf, root=root)
        if staged is not None:
            staged.finish()
        if self.rank == root:
            self._sent(t, self.size - 1)
        self.seconds += time.perf_counter() - t0
        return t

    def barrier(self) -> None:
        self._c.Barrier()

    # -- point to point ---------------------------------------------------------------------------
    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        t0 = time.perf_counter()
        buf, _ = self._buffer(t)
        self._c.Send(buf, dest=dest, tag=tag)
        self._sent(t)
        self.seconds += time.perf_counter() - t0

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Request:
        """Start sending ``t``; ``t`` must not change until the request completes."""
        t0 = time.perf_counter()
        buf, _ = self._buffer(t)
        req = self._c.Isend(buf, dest=dest, tag=tag)
        self._sent(t)
        self.seconds += time.perf_counter() - t0
        return Request(self, req, None, buf)

    def recv(self, t: torch.Tensor, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int]:
        """Receive into ``t``; returns ``(source, tag)`` of the message."""
        t0 = time.perf_counter()
        buf, staged = self._buffer(t, copy_in=False)
        status = MPI.Status()
        self._c.Recv(buf, source=source, tag=tag, status=status)
        if staged is not None:
            staged.finish()
        self.seconds += time.perf_counter() - t0
        return status.Get_source(), status.Get_tag()

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int] | None:
        """Non-blocking probe: ``(source, tag)`` of a waiting message, or None."""
        t0 = time.perf_counter()
        status = MPI.Status()
        found = self._c.Iprobe(source=source, tag=tag, status=status)
        self.seconds += time.perf_counter() - t0
        return (status.Get_source(), status.Get_tag()) if found else None

    def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int]:
        """Blocking probe: ``(source, tag)`` of the next matching message."""
        t0 = time.perf_counter()
        status = MPI.Status()
        self._c.Probe(source=source, tag=tag, status=status)
        self.seconds += time.perf_counter() - t0
        return status.Get_source(), status.Get_tag()

    # -- small Python objects (pickled; not for tensors) --------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        return self._c.allgather(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._c.bcast(obj, root=root)

    def allreduce_values(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Allreduce a short list of floats (metrics) in float64."""
        arr = np.asarray(values, dtype=np.float64)
        self._c.Allreduce(MPI.IN_PLACE, arr, op=_OPS[op])
        return arr.tolist()

    # -- structure --------------------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> Comm:
        """A sub-communicator of the ranks that pass the same ``color``."""
        return Comm(self._c.Split(color, self.rank if key is None else key), self.cuda_aware)

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


def mpi_library_version() -> str:
    return MPI.Get_library_version().strip().splitlines()[0]


def wait_all(requests: Sequence[Request]) -> None:
    for r in requests:
        r.wait()


def progress(requests: Sequence[Request]) -> None:
    """Drive pending non-blocking operations forward (MPI progresses only inside MPI calls)."""
    for r in requests:
        r.test()
