"""Queued all-reduces on MPI: run by the communicator's background thread (:mod:`runner.comm.background`).

The thread overlaps truly where MPI's non-blocking collectives would not."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.comm.routes.base import Carrier, Route

if TYPE_CHECKING:
    import torch

    from runner.comm.requests import BackgroundRequest


class BackgroundThread(Route):
    """``allreduce_background`` of every tensor no route before it took."""

    def allreduce_background(
        self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None
    ) -> BackgroundRequest:
        return comm.background().submit(t, op, wire)
