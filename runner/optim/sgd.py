"""Stochastic gradient descent with momentum: ``torch.optim.SGD``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from runner.optim import OptimConfig
from runner.schema import require

if TYPE_CHECKING:
    import torch


@dataclass
class SGDConfig(OptimConfig):
    """``torch.optim.SGD``'s arguments.

    PyTorch's update: with momentum μ and dampening d, b ← μ·b + (1 − d)·g, then x ← x − lr·b, or
    x ← x − lr·(g + μ·b) with Nesterov."""

    momentum: float = 0.9
    dampening: float = 0.0
    weight_decay: float = 0.0001
    nesterov: bool = False

    def __post_init__(self) -> None:
        require(self.lr >= 0, "lr", self.lr, "the learning rate must be >= 0 (e.g. optim.lr=0.05)")
        require(0 <= self.momentum < 1, "momentum", self.momentum, "momentum must be in [0, 1)")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        require(
            not self.nesterov or (self.momentum > 0 and self.dampening == 0),
            "nesterov",
            self.nesterov,
            "Nesterov momentum needs momentum > 0 and dampening = 0",
        )

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        return torch.optim.SGD(params, **asdict(self))
