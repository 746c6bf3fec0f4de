"""Pending operations: what a non-blocking call returns, completed by ``wait`` (or ``test``).

Over emulated links (:mod:`runner.comm.links`) a request holds its emulated ``transfer``
(:class:`~runner.comm.stats.Transfer`), which starts once the real operation is complete: ``wait`` pays
what is left of it, and ``test`` is true only once it is through. A request waited for after its transfer
is through pays nothing more: the transfer overlapped with what the rank did meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from runner.comm.errors import faulted
from runner.comm.stats import Transfer, clock

if TYPE_CHECKING:
    from runner.comm.face import RequestLike
    from runner.comm.staging import Staged


class Request:
    """A pending non-blocking MPI operation; ``wait`` completes it (and copies staged data back).

    It holds the buffer until then, so a temporary tensor cannot be freed while MPI still uses it. ``comm``:
    the communicator it runs on (its ``stats`` count the seconds, its ``tolerant`` maps the errors).
    """

    transfer: Transfer | None = None  # its emulated link's (runner/comm/links.py); None: none

    def __init__(self, comm: Any, req: Any, staged: Staged | None, buffer: Any):
        self._comm, self._req, self._staged, self._buffer = comm, req, staged, buffer

    @faulted
    def test(self) -> bool:
        """Whether the operation is complete (completing it if it is)."""
        with clock(self._comm.stats):
            done = self._req.Test()
        if done:
            self._complete()
        return done and (self.transfer is None or self.transfer.through())

    def _complete(self) -> None:
        if self._staged is not None:
            self._staged.finish()
        self._staged = self._buffer = None

    @faulted
    def wait(self) -> None:
        """Block until the operation is complete."""
        with clock(self._comm.stats):
            self._req.Wait()
            self._complete()
            if self.transfer is not None:
                self.transfer.wait()


class BackgroundRequest:
    """An all-reduce run by the communicator's background thread; ``wait`` blocks until it is done."""

    transfer: Transfer | None = None  # its emulated link's (runner/comm/links.py); None: none

    def __init__(self, comm: Any):
        self._comm, self._done, self.error = comm, threading.Event(), None
        self._finished = 0.0  # when the thread was done with it
        self.thread_sent = self.caller_sent = 0  # the bytes the thread sent for it, and its caller

    @property
    def sent(self) -> int:
        """The bytes sent for it (by the thread, and counted by its caller: a plain sum's)."""
        return self.thread_sent + self.caller_sent

    def test(self) -> bool:
        """Whether the all-reduce is done."""
        done = self._done.is_set()
        return done and (self.transfer is None or self.transfer.through(self._finished))

    def wait(self) -> None:
        """Block until the all-reduce is done; raise its error, if it failed."""
        with clock(self._comm.stats):
            self._done.wait()
            if self.transfer is not None and self.error is None:
                self.transfer.wait(self._finished)
        if self.error is not None:
            raise self.error

    def finish(self, error: BaseException | None = None) -> None:
        """The background thread: the all-reduce is done (``error``: it failed so)."""
        self.error, self._finished = error, time.perf_counter()
        self._done.set()


class DistRequest:
    """A collective running on the ``torch.distributed`` transport; ``wait`` completes it.

    On a GPU ``wait`` makes the current stream wait for it, without blocking the host. ``comm``: its
    communicator, which waits (:meth:`runner.comm.mpi.Comm.await_work`); ``work`` None: nothing is pending."""

    transfer: Transfer | None = None  # its emulated link's (runner/comm/links.py); None: none
    sent = 0  # the bytes sent for it (runner/comm/mpi.py's allreduce_background)

    def __init__(self, comm: Any, work: Any):
        self._comm, self._work = comm, work

    def test(self) -> bool:
        """Whether the collective is complete."""
        done = self._work is None or self._work.is_completed()
        return done and (self.transfer is None or self.transfer.through())

    def wait(self) -> None:
        """Complete the collective."""
        with clock(self._comm.stats):
            if self._work is not None:
                self._comm.await_work(self._work)
                self._work = None
            if self.transfer is not None:
                self.transfer.wait()


def wait_all(requests: Sequence[RequestLike]) -> None:
    """Complete every request, in order."""
    for r in requests:
        r.wait()


def progress(requests: Sequence[RequestLike]) -> None:
    """Drive pending non-blocking operations forward (MPI progresses only inside MPI calls)."""
    for r in requests:
        r.test()
