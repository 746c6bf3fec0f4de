"""A data set whose samples carry their index, and a model that records the indices it trains on, so a
test can tell which samples each worker trained (``data=dataset`` + ``model=custom``).

The model appends one line per training forward (the micro-batch's sample indices) to
``$MPITRAIN_TRACE/rank<r>.txt``; validation (eval mode) records nothing.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from torch import nn

from tests.helpers.plain_data import Blobs

TRACE_ENV = "MPITRAIN_TRACE"


class IndexedBlobs(Blobs):
    """:class:`Blobs` whose every point carries its own index as a last feature."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return torch.cat([x, torch.tensor([float(i)])]), y


def indexed_pair(size: int = 300, val_size: int = 60, **kwargs) -> tuple[IndexedBlobs, IndexedBlobs]:
    return IndexedBlobs(size, seed=0, **kwargs), IndexedBlobs(val_size, seed=1, **kwargs)


class Tracer(nn.Module):
    """A linear classifier of all features but the last (the index), which it records when training. On
    launch rank ``die_rank`` its ``die_at``-th training forward kills the process first (SIGKILL), so the
    rank's trace holds the batches it finished."""

    def __init__(self, in_features: int = 4, num_classes: int = 3, die_rank: int = -1, die_at: int = 0):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))
        folder = os.environ.get(TRACE_ENV)
        self.trace = Path(folder) / f"rank{self.rank}.txt" if folder else None
        self.die_rank, self.die_at, self.calls = die_rank, die_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.rank == self.die_rank and self.calls == self.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
        if self.training and self.trace is not None:
            with self.trace.open("a") as f:
                f.write(" ".join(str(int(i)) for i in x[:, -1].tolist()) + "\n")
        return self.linear(x[:, :-1])


def read_trace(folder: Path) -> dict[int, list[list[int]]]:
    """The micro-batches each rank trained on, in order, by rank."""
    out = {}
    for f in sorted(folder.glob("rank*.txt")):
        lines = f.read_text().splitlines()
        out[int(f.stem.removeprefix("rank"))] = [list(map(int, line.split())) for line in lines]
    return out


#: The overrides of a traced job: the data set and the model above, 300 training samples in chunks of 10.
OVERRIDES = [
    "data=dataset",
    "data.train._target_=tests.helpers.traced.indexed_pair",
    "data.shape=[5]",
    "data.num_classes=3",
    "model=custom",
    "model._target_=tests.helpers.traced.Tracer",
    "train.batch_size=10",
]
