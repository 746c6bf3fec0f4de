"""What an encoding is: one tensor's sums over a communicator in fewer bytes, with its error feedback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from runner.lazy import lazy_import

if TYPE_CHECKING:
    import torch

    from runner.comm.face import CommLike
    from runner.comm.links import Links
else:
    torch = lazy_import("torch")


def acc(t: torch.Tensor) -> torch.dtype:
    """The sums' type: float64 for a float64 tensor, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class Encoding:
    """One tensor's sums in an encoding, with this rank's error feedback.

    The communicator calls :meth:`reduce` (``Comm.allreduce(t, encoding=self)``, blocking or on its
    background thread) and spends :meth:`seconds` on emulated links once for it; the all-to-all and
    all-gather inside count their own bytes. Error feedback: a = t + e is encoded (SparseLoCo's decays e),
    this rank contributes c(a), and e ← a − c(a), the ``residual`` (a tensor like ``like``, flat);
    ``feedback`` False: no e, what is not sent is lost. One rank alone sends nothing and keeps ``t`` as it is.
    """

    name: ClassVar[str]

    def __init__(self, like: torch.Tensor, feedback: bool = True):
        self.residual = torch.zeros_like(like).view(-1) if feedback else None

    def reduce(self, comm: CommLike, t: torch.Tensor) -> torch.Tensor:
        """In place: ``t`` becomes the sum over ``comm`` of what every rank sends of its ``t``."""
        return t if comm.size == 1 else self._reduce(comm, t)

    def _reduce(self, comm: CommLike, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def seconds(self, links: Links, nodes: Sequence[int], t: torch.Tensor) -> float:
        """Emulated seconds of one :meth:`reduce` of ``t`` over ranks on ``nodes`` (in rank order)."""
        raise NotImplementedError

    def feedback(self) -> list[torch.Tensor]:
        """The error feedback's tensors (none without it)."""
        return [self.residual] if self.residual is not None else []

    def state(self) -> list[torch.Tensor]:
        """The error feedback's tensors, cloned (for checkpoints); empty without error feedback."""
        return [x.clone() for x in self.feedback()]

    def load(self, state: list[Any]) -> None:
        """Restore :meth:`state`'s tensors."""
        with torch.no_grad():
            for mine, saved in zip(self.feedback(), state, strict=True):
                mine.copy_(saved)
