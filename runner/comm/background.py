"""The communicator's background thread: blocking all-reduces run beside the computation.

Open MPI's non-blocking collectives progress only inside MPI calls and use slower algorithms; a thread
running the blocking call overlaps truly (MPI_THREAD_MULTIPLE). Requests complete in order, and every rank
must queue the same tensors in the same order. The thread counts no seconds: its requests' waits do; each
request holds the bytes the thread sent for it (``thread_sent``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from runner.comm.requests import BackgroundRequest
from runner.comm.stats import tally, uncounted_thread


class Background:
    """A thread that runs ``reduce(t, op, wire, encoding)`` for each queued tensor, in order, for ``comm``."""

    def __init__(self, comm: Any, reduce: Callable[[Any, str, Any, Any], None]):
        self._comm, self._reduce = comm, reduce
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="mpitrain-comm", daemon=True)
        self._thread.start()

    def submit(self, t: Any, op: str, wire: Any, encoding: Any = None) -> BackgroundRequest:
        """Queue the all-reduce of ``t`` (in ``wire``'s type, or by ``encoding``); its request."""
        assert not self._closed, "an all-reduce queued on a closed background thread would never run"
        request = BackgroundRequest(self._comm)
        self._queue.put((t, op, wire, encoding, request))
        return request

    def close(self) -> None:
        """End the thread once the all-reduces queued so far are done, without waiting for it.

        A thread stuck in a call on a lost peer must not hold its caller too."""
        self._closed = True
        self._queue.put(None)

    def drain(self) -> None:
        """Return once every all-reduce queued so far is done (the thread is idle)."""
        marker = BackgroundRequest(self._comm)
        self._queue.put((None, None, None, None, marker))
        marker._done.wait()

    def _serve(self) -> None:
        uncounted_thread()
        while (item := self._queue.get()) is not None:
            t, op, wire, encoding, request = item
            error = None
            with tally() as sent:
                try:
                    if t is not None:
                        self._reduce(t, op, wire, encoding)
                except BaseException as err:  # handed to the waiting thread
                    error = err
            request.thread_sent = sent.bytes
            request.finish(error)
