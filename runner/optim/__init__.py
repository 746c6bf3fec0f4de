"""Optimizers: one module per ``conf/optim`` option, each a schema that builds a ``torch.optim`` optimizer."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class OptimConfig:
    """Base of the optimizers' schemas."""

    lr: float = 0.05

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        raise NotImplementedError
