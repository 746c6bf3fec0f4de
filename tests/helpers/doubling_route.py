"""A route of the tests' own (tests/comm/test_routes.py): it takes the all-reduces of float64 tensors and
doubles them, so a test sees that a route registered with one line is used."""

from __future__ import annotations

import torch

from runner.comm.routes.base import Carrier, Route


class Doubling(Route):
    """All-reduces of float64 tensors: each value doubled (whatever the ranks)."""

    def takes(
        self, comm: Carrier, op: str, tensors: tuple[torch.Tensor, ...], wire: torch.dtype | None
    ) -> bool:
        return tensors[0].dtype == torch.float64

    def allreduce(self, comm: Carrier, t: torch.Tensor, op: str, wire: torch.dtype | None) -> None:
        t.mul_(2)
