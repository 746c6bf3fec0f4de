"""A model that raises on one rank after a few steps, to test how a failing rank ends the job."""

from __future__ import annotations

import os

import torch

from models.mlp import MLP

FAIL_RANK, FAIL_AT_CALL = 1, 5


class ExplodingMLP(MLP):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ExplodingMLP.calls += 1
        if int(os.environ.get("OMPI_COMM_WORLD_RANK", -1)) == FAIL_RANK and self.calls == FAIL_AT_CALL:
            raise RuntimeError(f"injected failure at forward call {self.calls}")
        return super().forward(x)
