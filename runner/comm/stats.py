"""What communication cost: bytes sent and seconds spent, each counted in one place.

The seconds of a call are counted once, by the outermost timed call of a thread (the 16-bit exchange's
all-to-all inside its all-reduce, a wait on the ``torch.distributed`` transport inside a broadcast add nothing
more), and none on the background thread, whose all-reduces count the time their requests are waited for.
The bytes are what a bandwidth-optimal algorithm sends per rank, as a share of the tensor (:func:`share`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_local = threading.local()  # busy: a timed call of this thread is running (or the thread is not counted)


@dataclass
class CommStats:
    """Bytes this rank sent and seconds it spent in communication, over all of its communicators."""

    bytes_sent: int = 0
    seconds: float = 0.0

    def sent(self, t: torch.Tensor, factor: float = 1.0) -> None:
        """Count ``factor`` times ``t``'s bytes as sent."""
        self.bytes_sent += int(t.numel() * t.element_size() * factor)


class clock:  # noqa: N801 (used as a function: ``with clock(stats):``)
    """Add the block's seconds to ``stats.seconds``, unless a timed block of this thread encloses it."""

    __slots__ = ("stats", "t0")

    def __init__(self, stats: CommStats):
        self.stats, self.t0 = stats, None

    def __enter__(self) -> None:
        if not getattr(_local, "busy", False):
            _local.busy = True
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> bool:
        if self.t0 is not None:
            _local.busy = False
            self.stats.seconds += time.perf_counter() - self.t0
        return False


def uncounted_thread() -> None:
    """Count no seconds on the calling thread from now on (the background thread: its requests' waits do)."""
    _local.busy = True


def share(op: str, size: int, root: bool = False) -> float:
    """The bytes a rank sends in ``op`` over ``size`` ranks, as a multiple of the tensor's: an all-reduce
    2(N-1)/N, a broadcast N-1 from the root (``root``: this rank is it) and none elsewhere, an all-to-all
    (N-1)/N of what it sends, an all-gather N-1 times it, a point-to-point message once."""
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
