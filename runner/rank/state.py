"""Where training stands (:class:`Position`), the run's length, and moving a model's state between ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from runner.comm import Comm


@dataclass
class Position:
    """Where training stands: ``step`` steps done, ``batch`` of them in epoch ``epoch``."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def run_length(
    epochs: int, max_steps: int | None, steps_per_epoch: int, epoch: int = 0, done: int = 0
) -> tuple[int, int]:
    """``(epochs, steps)`` a run takes: ``epochs`` epochs of ``steps_per_epoch`` steps, cut at ``max_steps``
    (``train.max_steps``; None: no cut). From epoch ``epoch`` on, ``done`` steps having been taken before
    it: the survivors of a lost worker re-plan with their longer epochs. ``steps`` is the schedule's and
    the progress's length."""
    ahead = done + (epochs - epoch) * steps_per_epoch
    steps = min(ahead, max_steps or ahead)
    return min(epochs, epoch + -(-(steps - done) // steps_per_epoch)), steps


def broadcast_state(model: nn.Module, comm: Comm, root: int = 0) -> None:
    """Give every rank ``root``'s parameters and buffers."""
    import torch

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, root=root)
