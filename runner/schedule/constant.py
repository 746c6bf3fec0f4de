"""A constant learning rate (after the warm-up, if any)."""

from __future__ import annotations

from dataclasses import dataclass

from runner.schedule import ScheduleConfig


@dataclass
class ConstantConfig(ScheduleConfig):
    """The rate ``optim.lr`` throughout, after a linear warm-up of ``warmup_steps`` steps."""

    def shape(self, step: int, steps: int) -> float:
        return 1.0
