"""The 1cycle policy (Smith & Topin 2018, "Super-Convergence", arXiv 1708.07120).

The learning-rate curve of ``torch.optim.lr_scheduler.OneCycleLR`` with cosine annealing in both phases (no
momentum cycling)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from runner.schedule import ScheduleConfig
from runner.schema import require


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2 * (1 + math.cos(math.pi * pct))


@dataclass
class OneCycleConfig(ScheduleConfig):
    """``optim.lr`` is the peak (OneCycleLR's ``max_lr``).

    Over a run of T steps the rate rises from lr/``div_factor`` at step 0 to lr at step ``pct_start``·T − 1,
    then falls to lr/(``div_factor``·``final_div_factor``) at step T − 1, both along a half cosine. The rise
    is the warm-up: ``warmup_steps`` must stay 0."""

    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.warmup_steps == 0,
            "warmup_steps",
            self.warmup_steps,
            "onecycle warms up by itself over the first pct_start of the run: set schedule.pct_start instead",
        )
        require(
            0 < self.pct_start < 1, "pct_start", self.pct_start, "the rising fraction of the run, in (0, 1)"
        )
        require(
            self.div_factor >= 1, "div_factor", self.div_factor, "the start is lr/div_factor: >= 1 (e.g. 25)"
        )
        require(
            self.final_div_factor >= 1,
            "final_div_factor",
            self.final_div_factor,
            "the end is lr/(div_factor·final_div_factor): >= 1 (e.g. 1e4)",
        )

    def shape(self, step: int, steps: int) -> float:
        start = 1.0 / self.div_factor
        end = start / self.final_div_factor
        peak = self.pct_start * steps - 1
        last = steps - 1
        if step <= peak:
            return _cos(start, 1.0, step / peak) if peak > 0 else 1.0
        if step >= last:
            return end
        return _cos(1.0, end, (step - peak) / (last - peak))
