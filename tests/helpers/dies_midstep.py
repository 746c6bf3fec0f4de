"""A model whose processes kill themselves (SIGKILL) a set time into one of their training steps, to test
kills that land anywhere in a step or after it: its backward, the rule's exchange, the workers' agreement.

Selected with ``hydra.searchpath=[file://tests/conf]`` and ``model=dies_midstep
model.kills=[[2,30,20],[3,40,5]]``: launch rank 2 dies 20 ms after its 30th training forward call began
(a daemon thread's timer), wherever it is then, and launch rank 3 5 ms after its 40th. A worker spawned
into the job counts as launch rank 0 of its own launch: kill ranks other than 0 to kill only launched
ones. ``model.holds=[[1,29,1500]]`` has launch rank 1 sleep 1.5 s in its 29th training forward call:
the others wait for it at the agreement after that step and all start the next step together, so a kill
timed from that step's start lands at the same point of it on every run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import torch

from runner.models.cnn import CNNConfig


def mine(events: list[tuple[int, int, float]]) -> dict[int, float]:
    """This process's ``(launch rank, call, seconds)`` of ``events``: seconds by call."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", -1))
    return {at: seconds for r, at, seconds in events if r == rank}


class DiesMidstep(torch.nn.Module):
    """Wraps a model; for each ``(rank, at, seconds)`` of ``kills``, the ``at``-th training forward call on
    launch rank ``rank`` starts a timer that kills the process ``seconds`` later; of ``holds``, that call
    sleeps ``seconds``."""

    def __init__(
        self,
        inner: torch.nn.Module,
        kills: list[tuple[int, int, float]],
        holds: list[tuple[int, int, float]],
    ):
        super().__init__()
        self.inner, self.kills, self.holds = inner, mine(kills), mine(holds)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not os.environ.get("MPITRAIN_TEST_NO_DIE"):
            self.calls += 1
            if self.calls in self.kills:
                timer = threading.Timer(self.kills[self.calls], os.kill, (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
            time.sleep(self.holds.get(self.calls, 0.0))
        return self.inner(x)


@dataclass
class DiesMidstepCNNConfig(CNNConfig):
    #: [launch rank, training forward call of that rank, milliseconds from that call's start to the kill]
    kills: list[list[int]] = field(default_factory=list)
    #: [launch rank, training forward call of that rank, milliseconds it sleeps in that call]
    holds: list[list[int]] = field(default_factory=list)

    def build(self) -> torch.nn.Module:
        kills = [(rank, at, ms / 1000) for rank, at, ms in self.kills]
        holds = [(rank, at, ms / 1000) for rank, at, ms in self.holds]
        return DiesMidstep(super().build(), kills, holds)
