"""The ``torch.distributed`` transport's route (``hardware.transport``: NCCL on GPUs, gloo on CPU).

It carries the collectives of the tensors of its device type, waited for by the communicator
(:meth:`Comm.await_work`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.comm.requests import DistRequest
from runner.comm.routes.base import Carrier, Route

if TYPE_CHECKING:
    import torch


class TorchDistributed(Route):
    """Every collective of tensors the attached transport carries (all of them of its device type)."""

    def takes(
        self, comm: Carrier, op: str, tensors: tuple[torch.Tensor, ...], wire: torch.dtype | None
    ) -> bool:
        return comm.dist is not None and all(comm.dist.takes(t) for t in tensors)

    def allreduce(self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None) -> None:
        comm.await_work(comm.dist.allreduce(t, op))

    def iallreduce(self, comm: Carrier, t: torch.Tensor, op: str) -> DistRequest:
        return DistRequest(comm, comm.dist.allreduce(t, op))

    def allreduce_background(
        self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None
    ) -> DistRequest:
        """No thread: the backend runs the all-reduce on a stream (NCCL) or threads (gloo) of its own.

        The 16-bit exchange's steps queue on the backend's stream (NCCL), and the request is complete."""
        if wire is not None:
            comm.allreduce(t, op, wire)
            return DistRequest(comm, None)
        return self.iallreduce(comm, t, op)

    def broadcast(self, comm: Carrier, t: torch.Tensor, root: int) -> None:
        comm.await_work(comm.dist.broadcast(t, root))

    def alltoall(self, comm: Carrier, send: torch.Tensor, recv: torch.Tensor) -> None:
        comm.await_work(comm.dist.alltoall(send, recv))

    def allgather(self, comm: Carrier, send: torch.Tensor, recv: torch.Tensor) -> None:
        comm.await_work(comm.dist.allgather(send, recv))
