"""Periods that change: a periodic rule's steps between exchanges, constant, by QSR's rule, or listed.

``rule.period_schedule`` for the rules that exchange every H steps (DiLoCo and SparseLoCo's ``inner_steps``,
BSP's ``avg_freq`` in ``mode: params``, EASGD's ``tau``, SPARTA's ``interval``); the rule's own key stays the
base period H_base:

* ``constant``: every round H_base steps, exactly as without a schedule (the exchanges fall on the global
  steps that are multiples of H_base, before and after a resume);
* ``qsr``: the Quadratic Synchronization Rule (Gu et al., ICLR 2024, arXiv 2310.14423): a round that starts
  at learning rate η lasts H = max(H_base, ⌊(α/η)²⌋) steps, α = ``rule.qsr_alpha``: rounds lengthen as the
  rate decays (fewer exchanges late in training, where the paper finds they also generalize better). η is the
  optimizer's rate of its first parameter group where the round starts (the schedule's, times the rule's own
  factor), the same on every worker. The rule is for a decaying rate: while η is at the highest rate a round
  started at so far (the first round, a warm-up, a constant rate) rounds last H_base; the paper's α keeps
  (α/η_peak)² below H_base anyway;
* ``list``: the rounds' lengths in turn (``rule.period_list=[5,10,20]``), the last one repeated.

A round's length is fixed when it starts, so every worker agrees on it without a message. The position (the
global step that ends the round, rounds begun) is rule state: checkpoints carry it, a joining worker takes
worker 0's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runner.schema import one_of, require

SCHEDULES = ("constant", "qsr", "list")


@dataclass
class PeriodicConfig:
    """The keys of a period schedule (the module's docstring), mixed into a periodic rule's schema.

    It comes before the ``RuleConfig`` base (``class DiLoCoConfig(PeriodicConfig, RuleConfig)``) and is not
    a schema of its own."""

    period_schedule: str = "constant"
    qsr_alpha: float = 0.0
    period_list: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()  # (RuleConfig's, next in the rule's schema's order)
        one_of("period_schedule", self.period_schedule, SCHEDULES)
        kind = self.period_schedule
        require(
            (self.qsr_alpha > 0) == (kind == "qsr"),
            "qsr_alpha",
            self.qsr_alpha,
            "QSR's α (> 0) goes with rule.period_schedule=qsr, e.g. rule.qsr_alpha=0.2 (rounds last "
            "max(base, (α/lr)²) steps); with another schedule leave it 0",
        )
        require(
            (len(self.period_list) > 0) == (kind == "list") and all(h >= 1 for h in self.period_list),
            "period_list",
            self.period_list,
            "the rounds' lengths (each >= 1, the last repeated) go with rule.period_schedule=list, e.g. "
            "rule.period_schedule=list rule.period_list=[5,10,20]; with another schedule leave it []",
        )

    def fixed_period(self, why: str) -> None:
        """For a rule whose rounds cannot change length (``why``): refuse any schedule but ``constant``."""
        require(
            self.period_schedule == "constant",
            "period_schedule",
            self.period_schedule,
            f"{why}; use rule.period_schedule=constant",
        )


class Periods:
    """Where a rule stands in its schedule of rounds (the module's docstring)."""

    def __init__(self, cfg: PeriodicConfig, base: int):
        self.kind, self.base = cfg.period_schedule, base
        self.alpha, self.listed = cfg.qsr_alpha, list(cfg.period_list)
        self.end: int | None = None  # the global step count at which the current round ends
        self.rounds = 0  # rounds begun
        self.current = base  # the current round's length
        self.peak = 0.0  # the highest rate a round started at

    def length(self, lr: float) -> int:
        """The length of the round that begins now (at rate ``lr``); counts it as begun."""
        if self.kind == "qsr":
            self.peak, decayed = max(self.peak, lr), 0 < lr < self.peak
            h = (
                max(self.base, math.floor((self.alpha / lr) ** 2 + 1e-9)) if decayed else self.base
            )  # (0.3/0.05)²
        elif self.kind == "list":
            h = self.listed[min(self.rounds, len(self.listed) - 1)]
        else:
            h = self.base
        self.rounds += 1
        self.current = h
        return h

    def due(self, step: int, lr: float) -> bool:
        """Whether an exchange ends global step ``step`` (0-based); if so the next round begins at ``lr``.

        ``constant`` keeps the multiples of the base period (as the rules always did)."""
        if self.kind == "constant":
            return (step + 1) % self.base == 0
        if self.end is None:
            self.end = self.length(lr)  # the first round begins at step 0
        if step + 1 < self.end:
            return False
        self.end = step + 1 + self.length(lr)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"end": self.end, "rounds": self.rounds, "current": self.current, "peak": self.peak}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (a checkpoint from before schedules has none: constant)."""
        if state:
            self.end, self.rounds, self.current = state["end"], state["rounds"], state["current"]
            self.peak = state["peak"]


def rate(optimizer: Any) -> float:
    """The optimizer's current learning rate (its first group's), 0 without an optimizer (servers)."""
    return float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 0.0
