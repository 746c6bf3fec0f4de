"""One communication call of a communicator: MPI's failure errors mapped, its seconds counted once."""

from __future__ import annotations

import functools
from typing import Any

from runner.comm.errors import F, faults
from runner.comm.stats import clock


class Call:
    """One communication call of ``comm``: its MPI failure errors mapped, its seconds counted once.

    MPI's failure errors become :class:`PeerLost` (:class:`~runner.comm.errors.faults`); the seconds are
    counted by :class:`~runner.comm.stats.clock`."""

    __slots__ = ("clock", "faults")

    def __init__(self, comm: Any, what: str):
        self.faults, self.clock = faults(comm, what), clock(comm.stats)

    def __enter__(self) -> None:
        self.clock.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        self.clock.__exit__(*exc)
        return self.faults.__exit__(*exc)


def communication(fn: F) -> F:
    """A method of :class:`Comm` that is one communication :class:`Call`."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with Call(self, fn.__name__):
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
