"""Step decay (as ``torch.optim.lr_scheduler.MultiStepLR``).

The rate is multiplied by ``gamma`` at each of the ``milestones``, given in absolute optimizer steps (from the
first step, warm-up included)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from omegaconf import MISSING

from runner.schedule import ScheduleConfig
from runner.schema import require


@dataclass
class StepConfig(ScheduleConfig):
    """From optimizer step ``milestones[i]`` on, the factor is ``gamma ** (i + 1)``.

    The milestones come after the warm-up (e.g. ``schedule.milestones=[3000,6000] schedule.gamma=0.1``)."""

    milestones: list[int] = MISSING
    gamma: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        hint = "increasing optimizer steps after the warm-up, e.g. schedule.milestones=[3000,6000]"
        require(len(self.milestones) >= 1, "milestones", self.milestones, hint)
        require(
            all(a < b for a, b in zip(self.milestones, self.milestones[1:], strict=False)),
            "milestones",
            self.milestones,
            hint,
        )
        require(
            self.milestones[0] > self.warmup_steps,
            "milestones",
            self.milestones,
            f"the first milestone must come after the warm-up (warmup_steps={self.warmup_steps}): {hint}",
        )
        require(
            0 < self.gamma <= 1, "gamma", self.gamma, "the factor at each milestone, in (0, 1] (e.g. 0.1)"
        )

    def shape(self, step: int, steps: int) -> float:
        return self.gamma ** bisect.bisect_right(self.milestones, step + self.warmup_steps)
