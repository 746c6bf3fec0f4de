"""MPI itself, the last route: every collective.

It runs on a view of a CPU tensor, the device memory of a CUDA tensor (CUDA-aware MPI) or a staged host copy
(:mod:`runner.comm.staging`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.comm.binding import MPI, OPS
from runner.comm.requests import Request
from runner.comm.routes.base import Carrier, Route

if TYPE_CHECKING:
    import torch


class MpiBuffers(Route):
    """Every collective but the queued all-reduce (:mod:`runner.comm.routes.thread`), on MPI's buffer API."""

    def allreduce(self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None) -> None:
        buf, staged = comm.buffers.get(t)
        comm._c.Allreduce(MPI.IN_PLACE, buf, op=OPS[op])
        if staged is not None:
            staged.finish()

    def iallreduce(self, comm: Carrier, t: torch.Tensor, op: str) -> Request:
        buf, staged = comm.buffers.get(t)
        return Request(comm, comm._c.Iallreduce(MPI.IN_PLACE, buf, op=OPS[op]), staged, buf)

    def broadcast(self, comm: Carrier, t: torch.Tensor, root: int) -> None:
        buf, staged = comm.buffers.get(t)
        comm._c.Bcast(buf, root=root)
        if staged is not None:
            staged.finish()

    def alltoall(self, comm: Carrier, send: torch.Tensor, recv: torch.Tensor) -> None:
        out, staged = comm.buffers.get(recv, copy_in=False)
        comm._c.Alltoall(comm.buffers.get(send)[0], out)
        if staged is not None:  # a staged receive buffer (GPU without CUDA-aware MPI) is copied back
            staged.finish()

    def allgather(self, comm: Carrier, send: torch.Tensor, recv: torch.Tensor) -> None:
        out, staged = comm.buffers.get(recv, copy_in=False)
        comm._c.Allgather(comm.buffers.get(send)[0], out)
        if staged is not None:
            staged.finish()
