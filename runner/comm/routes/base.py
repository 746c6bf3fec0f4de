"""What a route is: one way a tensor collective travels.

A route says whether it takes a call, and performs it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from runner.comm.face import RequestLike
    from runner.comm.staging import Buffers

#: The operations a route may perform, as :class:`runner.comm.mpi.Comm`'s methods of the same names.
OPERATIONS = ("allreduce", "iallreduce", "allreduce_background", "broadcast", "alltoall", "allgather")


class Carrier(Protocol):
    """What a route uses of its communicator (:class:`runner.comm.mpi.Comm`)."""

    rank: int
    size: int
    dist: Any  # the torch.distributed transport (runner/comm/dist.py), or None
    buffers: Buffers  # what MPI is given for each tensor
    _c: Any  # the MPI communicator

    def await_work(self, work: Any) -> None: ...
    def allreduce(
        self, t: torch.Tensor, op: str = "sum", wire: torch.dtype | None = None
    ) -> torch.Tensor: ...
    def background(self) -> Any: ...


class Route:
    """One way tensors travel.

    A route performs the operations of :data:`OPERATIONS` it defines a method for (with the arguments of
    ``Comm``'s method of that name after the communicator), for the calls it :meth:`takes`; a communicator
    tries its routes in order (``runner.comm.routes.ROUTES``) and the first that takes a call performs it.
    Timing, byte accounting and the mapping of MPI's errors are the communicator's: a route only moves the
    data."""

    def performs(self, op: str) -> bool:
        """Whether this route defines operation ``op``."""
        return op in OPERATIONS and callable(getattr(self, op, None))

    def takes(
        self, comm: Carrier, op: str, tensors: tuple[torch.Tensor, ...], wire: torch.dtype | None
    ) -> bool:
        """Whether this route carries operation ``op`` of ``tensors`` (``wire``: the 16-bit type asked)."""
        return True

    if TYPE_CHECKING:  # the operations a route may define (a route defines only those it performs)

        def allreduce(self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None) -> None: ...
        def iallreduce(self, comm: Carrier, t: torch.Tensor, op: str) -> RequestLike: ...
        def allreduce_background(
            self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None
        ) -> RequestLike: ...
        def broadcast(self, comm: Carrier, t: torch.Tensor, root: int) -> None: ...
        def alltoall(self, comm: Carrier, send: torch.Tensor, recv: torch.Tensor) -> None: ...
        def allgather(self, comm: Carrier, send: torch.Tensor, recv: torch.Tensor) -> None: ...
