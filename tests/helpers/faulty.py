"""A model that raises on one rank after a few steps, to test how a failing rank ends the job.

Selected with ``hydra.searchpath=[file://tests/conf]`` and ``model=exploding`` (``tests/conf/model``), whose
YAML takes this module's schema by its dotted path, as a user's own model would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from runner.models.mlp import MLPConfig

FAIL_RANK, FAIL_AT_CALL = 1, 5


class Exploding(torch.nn.Module):
    """Wraps a model; its ``FAIL_AT_CALL``-th forward call on rank ``FAIL_RANK`` raises."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if int(os.environ.get("OMPI_COMM_WORLD_RANK", -1)) == FAIL_RANK and self.calls == FAIL_AT_CALL:
            raise RuntimeError(f"injected failure at forward call {self.calls}")
        return self.inner(x)


@dataclass
class ExplodingMLPConfig(MLPConfig):
    def build(self) -> torch.nn.Module:
        return Exploding(super().build())
