"""What communication cost: bytes sent and seconds spent, each counted in one place.

The seconds of a call are counted once, by the outermost timed call of a thread (the 16-bit exchange's
all-to-all inside its all-reduce, a wait on the ``torch.distributed`` transport inside a broadcast add nothing
more), and none on the background thread, whose all-reduces count the time their requests are waited for.
The bytes are what a bandwidth-optimal algorithm sends per rank, as a share of the tensor (:func:`share`).

Emulated links (:mod:`runner.comm.links`) are spent here too, once per outermost call: a blocking call
owes (:func:`owe`) its link's seconds and pays them when it ends, after the real operation; a non-blocking
one's request holds a :class:`Transfer`, which starts when the real operation is complete (as the thread
that ran it, or the first ``test`` or ``wait`` that finds it so, sees it) and whose end the request's wait
pays what is left of. One rank's transfers share its link in the order they are booked
(:meth:`CommStats.book`: a transfer starts when the one before it is through). The seconds paid are
counted both in ``seconds`` and apart, in ``emulated_seconds``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from runner.comm.links import Links

#: Per thread: ``depth`` (timed calls open), ``uncounted`` (the background thread), ``owed`` (link seconds the
#: outermost call owes), ``due`` (the latest end of a request's emulated transfer that it waits for) and
#: ``tally`` (the bytes sent inside an open :class:`tally`, else None).
_local = threading.local()


@dataclass
class CommStats:
    """Bytes this rank sent and seconds it spent in communication, over all of its communicators.

    ``links``: the emulated links its messages and collectives cross (None: none are emulated), whose waits
    are counted in ``emulated_seconds`` as well."""

    bytes_sent: int = 0
    seconds: float = 0.0
    emulated_seconds: float = 0.0
    links: Links | None = None
    link_free: float = field(default=0.0, repr=False)  # when this rank's link is through with its transfers
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def sent(self, t: torch.Tensor, factor: float = 1.0) -> None:
        """Count ``factor`` times ``t``'s bytes as sent (by any thread; also in its :class:`tally`)."""
        nbytes = int(t.numel() * t.element_size() * factor)
        with self._lock:
            self.bytes_sent += nbytes
        if getattr(_local, "tally", None) is not None:
            _local.tally += nbytes

    def book(self, seconds: float, start: float | None = None) -> float:
        """Book ``seconds`` of this rank's link for a transfer that starts at ``start`` (default now).

        It goes after the transfers booked before it; returns when it is through (``time.perf_counter``'s
        clock)."""
        start = time.perf_counter() if start is None else start
        with self._lock:
            self.link_free = max(start, self.link_free) + seconds
            return self.link_free

    def pay(self, due: float) -> None:
        """Wait until ``due`` (sleeping, or busy with the links' ``spin``); counted as emulated seconds."""
        left = due - time.perf_counter()
        if left <= 0:
            return
        if self.links is not None and self.links.spin:
            while time.perf_counter() < due:
                pass
        else:
            time.sleep(left)
        self.emulated_seconds += left


class clock:  # noqa: N801 (used as a function: ``with clock(stats):``)
    """Add the block's seconds to ``stats.seconds``, unless a timed block of this thread encloses it.

    The outermost block ends by paying its emulated link seconds: those it owes (:func:`owe`), and until the
    end of the transfers waited for inside it (:meth:`Transfer.wait`)."""

    __slots__ = ("stats", "t0")

    def __init__(self, stats: CommStats):
        self.stats, self.t0 = stats, None

    def __enter__(self) -> None:
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        if depth == 0 and not getattr(_local, "uncounted", False):
            _local.owed, _local.due = 0.0, 0.0
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> bool:
        _local.depth -= 1
        if self.t0 is not None:
            try:
                if _local.owed and exc[0] is None:
                    _local.due = max(_local.due, self.stats.book(_local.owed))
                if _local.due and exc[0] is None:
                    self.stats.pay(_local.due)
            finally:
                self.stats.seconds += time.perf_counter() - self.t0
        return False


def counted() -> bool:
    """Whether a timed call of this thread is open, and its seconds are counted."""
    return getattr(_local, "depth", 0) > 0 and not getattr(_local, "uncounted", False)


def outermost() -> bool:
    """Whether the call running is the outermost timed call of a counted thread.

    That call spends the emulated link seconds of what it does (the calls inside it spend none)."""
    return getattr(_local, "depth", 0) == 1 and not getattr(_local, "uncounted", False)


def owe(seconds: float) -> None:
    """The outermost call running owes ``seconds`` of its link (paid when it ends).

    Inside another call, or on an uncounted thread, nothing is owed."""
    if seconds and outermost():
        _local.owed += seconds


class Transfer:
    """A non-blocking operation's emulated transfer: ``seconds`` of its rank's link.

    It runs from when the real operation is complete (the link's earlier transfers permitting) until
    ``due``."""

    __slots__ = ("due", "seconds", "stats")

    def __init__(self, stats: CommStats, seconds: float):
        self.stats, self.seconds, self.due = stats, seconds, None

    def complete(self, at: float | None = None) -> float:
        """The real operation is complete (since ``at``, default now): when the transfer is through."""
        if self.due is None:
            self.due = self.stats.book(self.seconds, at)
        return self.due

    def through(self, at: float | None = None) -> bool:
        """Whether the transfer of a complete operation (since ``at``) is through."""
        return time.perf_counter() >= self.complete(at)

    def wait(self, at: float | None = None) -> None:
        """Have the outermost timed call end when the transfer is through (on an uncounted thread, nothing).

        For use inside a request's wait, once its operation is complete (since ``at``)."""
        due = self.complete(at)
        if counted():
            _local.due = max(_local.due, due)


class tally:  # noqa: N801 (used as a function: ``with tally() as sent:``)
    """The bytes this thread counts as sent inside the block (``sent.bytes`` once it ends).

    An enclosing block's tally counts them too."""

    __slots__ = ("bytes", "outer")

    def __enter__(self) -> tally:
        self.bytes, self.outer = 0, getattr(_local, "tally", None)
        _local.tally = 0
        return self

    def __exit__(self, *exc: object) -> bool:
        self.bytes = _local.tally
        _local.tally = None if self.outer is None else self.outer + self.bytes
        return False


def uncounted_thread() -> None:
    """Count no seconds on the calling thread from now on (the background thread: its requests' waits do)."""
    _local.uncounted = True


def share(op: str, size: int, root: bool = False) -> float:
    """The bytes a rank sends in ``op`` over ``size`` ranks, as a multiple of the tensor's.

    An all-reduce 2(N-1)/N, a broadcast N-1 from the root (``root``: this rank is it) and none elsewhere, an
    all-to-all (N-1)/N of what it sends, an all-gather N-1 times it, a point-to-point message once."""
    if op in ("allreduce", "iallreduce", "allreduce_background"):
        return 2 * (size - 1) / size if size > 1 else 0.0
    if op == "broadcast":
        return size - 1 if root else 0.0
    if op == "alltoall":
        return (size - 1) / size
    if op == "allgather":
        return size - 1
    assert op in ("send", "isend"), op
    return 1.0
