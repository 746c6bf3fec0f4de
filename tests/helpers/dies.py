"""A model whose process kills itself (SIGKILL, as the OOM killer would) at one training forward call on one
rank, to test ``hardware.fault_tolerance=continue``.

Selected with ``hydra.searchpath=[file://tests/conf]`` and ``model=dies model.die_rank=2 model.die_at=30``.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.models.cnn import CNNConfig


class Dies(torch.nn.Module):
    """Wraps a model; its ``at``-th training forward call on launch rank ``rank`` kills the process."""

    def __init__(self, inner: torch.nn.Module, rank: int, at: int):
        super().__init__()
        self.inner, self.rank, self.at, self.calls = inner, rank, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not os.environ.get("MPITRAIN_TEST_NO_DIE"):  # (set: a resumed run lives on)
            self.calls += 1
            if self.calls == self.at and int(os.environ.get("OMPI_COMM_WORLD_RANK", -1)) == self.rank:
                stamp = os.environ.get("MPITRAIN_KILL_STAMP")  # benchmarks/fault_tolerance.py: when
                if stamp:
                    Path(stamp).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x)


@dataclass
class DiesCNNConfig(CNNConfig):
    die_rank: int = 2
    die_at: int = 30  # training forward calls of that rank

    def build(self) -> torch.nn.Module:
        return Dies(super().build(), self.die_rank, self.die_at)
