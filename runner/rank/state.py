"""Where training stands (:class:`Position`), the run's length, and moving a model's state between ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch import nn

    from runner.comm.face import CommLike


@dataclass
class Position:
    """Where training stands: ``step`` steps done, ``batch`` of them in epoch ``epoch``."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


class Owner:
    """A part of a worker that owns some of its training state.

    ``STATE`` names the attributes :meth:`state_dict` carries; ``TRANSIENT`` every other attribute the part
    sets, with why it is not training state (tests/rank/test_trainer_state.py holds each part to the two, so
    a new attribute is declared one or the other)."""

    STATE: ClassVar[tuple[str, ...]] = ()
    TRANSIENT: ClassVar[dict[str, str]] = {}

    def state_dict(self, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
        """The state ``keys`` name (default: all of ``STATE``)."""
        return {name: getattr(self, name) for name in self.STATE if keys is None or name in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned, or a part of it."""
        for name, value in state.items():
            assert name in self.STATE, f"{type(self).__name__} owns no state {name!r}"
            setattr(self, name, value)


def run_length(
    epochs: int, max_steps: int | None, steps_per_epoch: int, epoch: int = 0, done: int = 0
) -> tuple[int, int]:
    """``(epochs, steps)`` a run takes: ``epochs`` epochs of ``steps_per_epoch`` steps, cut at ``max_steps``.

    ``max_steps`` is ``train.max_steps`` (None: no cut). From epoch ``epoch`` on, ``done`` steps having been
    taken before it: the survivors of a lost worker re-plan with their longer epochs. ``steps`` is the
    schedule's and the progress's length."""
    ahead = done + (epochs - epoch) * steps_per_epoch
    steps = min(ahead, max_steps or ahead)
    return min(epochs, epoch + -(-(steps - done) // steps_per_epoch)), steps


def broadcast_state(model: nn.Module, comm: CommLike, root: int = 0) -> None:
    """Give every rank ``root``'s parameters and buffers."""
    import torch

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, root=root)
