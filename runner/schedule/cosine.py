"""Cosine annealing without restarts (Loshchilov & Hutter 2017, "SGDR", arXiv 1608.03983)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from runner.schedule import ScheduleConfig
from runner.schema import require


@dataclass
class CosineConfig(ScheduleConfig):
    """From 1 down to ``min_factor`` over the T steps after the warm-up.

    At the t-th of them the factor is min_factor + (1 − min_factor)·(1 + cos(π·t/T))/2 (the last step's is
    just above min_factor)."""

    min_factor: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            0 <= self.min_factor <= 1,
            "min_factor",
            self.min_factor,
            "the final fraction of the learning rate, in [0, 1] (e.g. 0.01)",
        )

    def shape(self, step: int, steps: int) -> float:
        progress = min(1.0, step / steps)
        return self.min_factor + (1.0 - self.min_factor) * (1.0 + math.cos(math.pi * progress)) / 2
