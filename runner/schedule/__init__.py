"""Learning-rate schedules: one module per ``conf/schedule`` option.

Each is a schema whose :meth:`shape` is the rule's curve; :class:`Schedule` sets the optimizer's learning
rates from it before every optimizer step.

At optimizer step ``s`` (0-based: the steps done before this one) of a run of ``T`` steps, every param group's
learning rate is

    lr(s) = lr₀ · warm-up(s) · shape(s − W, T − W) · rule(s)

where lr₀ is the group's learning rate when the schedule is built (``optim.lr``), W = ``warmup_steps``,
warm-up(s) = a + (1 − a)·s/W for s < W and 1 after (a = ``warmup_start``: the fraction at the first step; the
default 0 makes the first step's rate 0, as Goyal et al. 2017 and Hugging Face's schedules do), the shape is
evaluated at 0 during the warm-up, and rule(s) is the rule's own factor (BSP's ``lr_scaling``). The rate is a
pure function of the step, so a resumed run needs no schedule state. Every rule's workers step a local
optimizer and the schedule sets its rates: with EASGD, GoSGD and ASGD each worker's, with DiLoCo the inner one
(its outer learning rate stays ``rule.outer_lr``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.schema import require

if TYPE_CHECKING:
    import torch


@dataclass
class ScheduleConfig:
    """Base of the schedules' schemas: a linear warm-up over the first ``warmup_steps`` optimizer steps.

    The warm-up goes from ``warmup_start`` × the rate to the rate, in front of every schedule's shape."""

    warmup_steps: int = 0
    warmup_start: float = 0.0

    def __post_init__(self) -> None:
        require(
            self.warmup_steps >= 0,
            "warmup_steps",
            self.warmup_steps,
            "optimizer steps of linear warm-up, >= 0 (e.g. schedule.warmup_steps=500; 0: none)",
        )
        require(
            0 <= self.warmup_start < 1,
            "warmup_start",
            self.warmup_start,
            "the fraction of the learning rate at the first warm-up step, in [0, 1) (e.g. 0.1)",
        )

    def check_length(self, steps: int, given: str, fix: str) -> None:
        """The warm-up is no longer than a run of ``steps`` optimizer steps, else a ValueError.

        ``given`` says what sets that count, ``fix`` how to lengthen it; the ValueError names both: the rate
        would never reach ``optim.lr``, and no schedule would follow."""
        if self.warmup_steps > steps:
            raise ValueError(
                f"schedule.warmup_steps={self.warmup_steps} is invalid: it is longer than the run, {steps} "
                f"optimizer steps ({given}), so the rate would never reach optim.lr; give a shorter warm-up "
                f"(e.g. schedule.warmup_steps={max(1, steps // 10)}, a tenth of the run), or {fix}"
            )

    def shape(self, step: int, steps: int) -> float:
        """The schedule's factor ``step`` steps after the warm-up, of ``steps`` steps after the warm-up."""
        raise NotImplementedError

    def warmup(self, step: int) -> float:
        """The warm-up's factor at optimizer step ``step``: linear from ``warmup_start`` to 1."""
        if step >= self.warmup_steps:
            return 1.0
        return self.warmup_start + (1.0 - self.warmup_start) * step / self.warmup_steps

    def factor(self, step: int, total_steps: int) -> float:
        """The multiplier of the initial learning rate at optimizer step ``step`` (0-based): warm-up × shape.

        ``total_steps``: the run's length. A run shorter than its warm-up ends during the warm-up."""
        after = max(0, step - self.warmup_steps)
        return self.warmup(step) * self.shape(after, max(1, total_steps - self.warmup_steps))

    def build(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        rule_factor: Callable[[int], float] = lambda step: 1.0,
    ) -> Schedule:
        """The schedule of ``optimizer``'s learning rates over ``total_steps`` optimizer steps.

        Build it before loading a checkpoint's optimizer state (the initial rates are read from the groups
        now). A warm-up longer than the run is refused here, on the ranks, which know an epoch's steps."""
        self.check_length(
            total_steps,
            "train.max_steps, or train.epochs × the steps of an epoch, whichever ends first",
            "train longer (train.epochs, train.max_steps)",
        )
        return Schedule(self, optimizer, total_steps, rule_factor)


class Schedule:
    """Sets every param group's learning rate before each optimizer step (:meth:`apply`).

    lr = its initial lr × ``cfg.factor(step, total_steps)`` × ``rule_factor(step)``; other group keys are left
    alone."""

    def __init__(
        self,
        cfg: ScheduleConfig,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        rule_factor: Callable[[int], float] = lambda step: 1.0,
    ):
        assert total_steps >= 1, f"total_steps={total_steps}: a run has at least one optimizer step"
        self.cfg, self.optimizer, self.total_steps, self.rule_factor = (
            cfg,
            optimizer,
            total_steps,
            rule_factor,
        )
        self.initial_lrs = [float(group["lr"]) for group in optimizer.param_groups]

    def lr(self, step: int) -> list[float]:
        """The learning rate of each param group at optimizer step ``step`` (what :meth:`apply` sets)."""
        factor = self.cfg.factor(step, self.total_steps) * self.rule_factor(step)
        assert math.isfinite(factor), f"learning-rate factor {factor} at step {step}"
        return [lr * factor for lr in self.initial_lrs]

    def replan(self, total_steps: int) -> None:
        """The run's length changed: the schedule spans the new length from now on.

        Survivors of a lost worker share its data, so their later epochs are longer. The rate may step once
        here."""
        assert total_steps >= 1, f"total_steps={total_steps}: a run has at least one optimizer step"
        self.total_steps = total_steps

    #: What :meth:`state_dict` carries, and every other attribute with why not (runner.rank.state.Owner).
    STATE = ("total_steps",)
    TRANSIENT = {name: "given" for name in ("cfg", "optimizer", "rule_factor")} | {
        "initial_lrs": "read from the optimizer it is given"
    }

    def state_dict(self) -> dict[str, Any]:
        return {"total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the run's length from :meth:`state_dict` (re-planned when it differs)."""
        if state["total_steps"] != self.total_steps:
            self.replan(state["total_steps"])

    def apply(self, step: int) -> None:
        """Set the learning rates for optimizer step ``step``; call it before that step."""
        for group, lr in zip(self.optimizer.param_groups, self.lr(step), strict=True):
            if hasattr(group["lr"], "fill_"):  # a tensor learning rate (capturable or fused optimizers)
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
