"""A lost peer as one exception: ULFM's failure errors of an MPI call mapped to :class:`PeerLost`.

The mapping is in this one place."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from runner.comm.binding import MPI

#: ULFM's error classes: a peer failed (75, 76 for a pending wildcard receive) or revoked the communicator.
FAULTS = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
F = TypeVar("F", bound=Callable[..., Any])


class PeerLost(RuntimeError):
    """A process of the communicator died, or a survivor revoked the communicator after seeing one die.

    Raised by every communication call when the job runs with ``hardware.fault_tolerance=continue``
    (MPI's ULFM, errors returned instead of aborting); without it a lost process aborts the job in MPI.
    """


class Tolerant(Protocol):
    """What the mapping reads of a communicator (whether peers may die) and writes (a call raised)."""

    tolerant: bool
    saw_loss: bool


#: Where mpi4py loads a received object: an error there, under fault tolerance, is a torn message.
UNPICKLE_SOURCE = "msgpickle.pxi"


def _unpickling(tb: Any) -> bool:
    """Whether an exception was raised where mpi4py unpickles a received message (its innermost frame)."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith(UNPICKLE_SOURCE)


class faults:  # noqa: N801 (used as a function: ``with faults(comm, what):``)
    """Turn ULFM's failure errors of the MPI calls in the block into :class:`PeerLost` (named ``what``).

    Under fault tolerance, any error (a collective cut short by a peer's death may fail with a generic class,
    or complete here with the dead peer's part unwritten: its object then fails to unpickle): the survivors'
    recovery then finds out whether a process was lost."""

    __slots__ = ("comm", "what")

    def __init__(self, comm: Tolerant, what: str):
        self.comm, self.what = comm, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> bool:
        if isinstance(err, MPI.Exception) and is_loss(err, self.comm.tolerant):
            self.comm.saw_loss = True
            raise PeerLost(f"{self.what}: {err.Get_error_string()}") from None
        if err is not None and self.comm.tolerant and _unpickling(tb):
            self.comm.saw_loss = True
            torn = type(err).__name__
            raise PeerLost(f"{self.what}: a received object did not unpickle ({torn})") from None
        return False


def is_loss(err: Any, tolerant: bool) -> bool:
    """Whether MPI error ``err`` counts as a lost peer.

    ULFM's failure classes, or any error of a tolerant communicator (why: :class:`faults`)."""
    return err.Get_error_class() in FAULTS or tolerant


def faulted(fn: F) -> F:
    """A method whose MPI errors are mapped by :func:`faults`, for its object's communicator.

    The communicator is ``self._comm``, else ``self``."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with faults(getattr(self, "_comm", self), fn.__name__):
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def failed_ranks(c: Any) -> list[int]:
    """The ranks, in MPI communicator ``c``, of the processes this one knows died (acknowledged or not)."""
    group = c.Get_failed()
    return MPI.Group.Translate_ranks(group, list(range(group.Get_size())), c.Get_group())


def agreed(c: Any, flag: int) -> bool:
    """ULFM's agreement (``MPI_Comm_agree``) of ``flag`` over the living ranks of MPI communicator ``c``.

    Whether it was 1 on all of them, the same answer on every one. A loss during it is acknowledged and the
    agreement taken again with 0 (what a lost rank would have said is unknown)."""
    while True:
        try:
            return bool(c.Agree(flag))
        except MPI.Exception as err:
            if err.Get_error_class() not in FAULTS:
                raise
            c.Ack_failed()
            flag = 0
