"""The 16-bit exchange (``rule.comm_dtype``): the route of all-reduces asked in a 16-bit ``wire`` type.

Over several ranks, such an all-reduce is an all-to-all and an all-gather in that type
(:mod:`runner.comm.wire`), which take their own routes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.comm.routes.base import Carrier, Route
from runner.comm.wire import allreduce as wire_allreduce

if TYPE_CHECKING:
    import torch


class Wire16(Route):
    """All-reduces in 16 bits, summed in float32; it keeps its buffers, by size, for its communicator."""

    def __init__(self) -> None:
        self.kept: dict[Any, Any] = {}

    def takes(
        self, comm: Carrier, op: str, tensors: tuple[torch.Tensor, ...], wire: torch.dtype | None
    ) -> bool:
        return wire is not None and comm.size > 1

    def allreduce(self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None) -> None:
        assert op == "sum", "16-bit exchange sums"
        assert wire is not None
        wire_allreduce(comm, t, wire, self.kept)  # type: ignore[arg-type]
