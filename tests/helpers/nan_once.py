"""A model whose output is NaN once, on one rank, to test ``train.on_nonfinite``.

Selected with ``hydra.searchpath=[file://tests/conf]`` and ``model=nan_once`` (``tests/conf/model``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from runner.models.mlp import MLPConfig

NAN_RANK, NAN_AT_CALL = 1, 5


class NaNOnce(torch.nn.Module):
    """Wraps a model; its ``NAN_AT_CALL``-th training forward call on rank ``NAN_RANK`` returns NaN."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.training:
            self.calls += 1
            rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", -1))
            if rank == NAN_RANK and self.calls == NAN_AT_CALL:
                out = out * float("nan")
        return out


@dataclass
class NaNOnceMLPConfig(MLPConfig):
    def build(self) -> torch.nn.Module:
        return NaNOnce(super().build())
