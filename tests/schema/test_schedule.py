"""Learning-rate schedules (``schedule=``): the rate at every step against the closed-form formulas, the
warm-up, a rule's factor, OneCycleLR, and the launcher's checks."""

from __future__ import annotations

import math

import pytest
import torch

from runner.schedule.constant import ConstantConfig
from runner.schedule.cosine import CosineConfig
from runner.schedule.onecycle import OneCycleConfig
from runner.schedule.step import StepConfig
from tests.conftest import checked_config

TOTAL, WARMUP, START = 120, 50, 0.1
LRS = [0.1, 0.02]


def optimizer() -> torch.optim.Optimizer:
    """SGD with two param groups of different rates and momentum (which no schedule may touch)."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    groups = [{"params": [a], "lr": LRS[0]}, {"params": [b], "lr": LRS[1], "momentum": 0.5}]
    return torch.optim.SGD(groups, momentum=0.9)


def warmup(s: int, steps: int = WARMUP, start: float = START) -> float:
    return start + (1 - start) * s / steps if s < steps else 1.0


def constant(s: int) -> float:
    return warmup(s)


def step_decay(s: int) -> float:
    return warmup(s) * 0.5 ** sum(s >= m for m in (70, 100))


def cosine(s: int) -> float:
    if s < WARMUP:
        return warmup(s)
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / (TOTAL - WARMUP)))


CASES = [
    (ConstantConfig(warmup_steps=WARMUP, warmup_start=START), constant),
    (StepConfig(warmup_steps=WARMUP, warmup_start=START, milestones=[70, 100], gamma=0.5), step_decay),
    (CosineConfig(warmup_steps=WARMUP, warmup_start=START, min_factor=0.05), cosine),
]


@pytest.mark.parametrize("cfg,formula", CASES, ids=["constant", "step", "cosine"])
def test_rate_at_every_step_is_the_formula(cfg, formula):
    opt = optimizer()
    schedule = cfg.build(opt, TOTAL)
    for s in range(TOTAL):
        schedule.apply(s)
        expected = [lr * formula(s) for lr in LRS]
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(expected, rel=1e-12, abs=1e-15), s
        assert schedule.lr(s) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.5]


@pytest.mark.parametrize("cfg", [c for c, _ in CASES], ids=["constant", "step", "cosine"])
def test_warmup_is_linear_from_warmup_start(cfg):
    factors = [cfg.factor(s, TOTAL) for s in range(WARMUP + 1)]
    assert factors[0] == pytest.approx(START)
    assert factors[WARMUP] == pytest.approx(1.0)
    steps = [b - a for a, b in zip(factors, factors[1:], strict=False)]
    assert steps == pytest.approx([(1 - START) / WARMUP] * WARMUP)


def test_default_warmup_starts_at_zero_and_none_means_none():
    assert CosineConfig(warmup_steps=4).factor(0, 10) == 0.0
    assert CosineConfig(warmup_steps=4).factor(2, 10) == pytest.approx(0.5)
    assert ConstantConfig().factor(0, 10) == 1.0
    assert CosineConfig().factor(0, 10) == 1.0


def test_run_shorter_than_its_warmup_ends_in_the_warmup():
    cfg = CosineConfig(warmup_steps=50)
    assert [cfg.factor(s, 6) for s in range(6)] == pytest.approx([s / 50 for s in range(6)])


def test_step_milestones_are_absolute_steps():
    cfg = StepConfig(warmup_steps=10, milestones=[20, 30], gamma=0.1)
    assert [cfg.factor(s, 40) for s in (19, 20, 29, 30, 39)] == pytest.approx([1, 0.1, 0.1, 0.01, 0.01])


def test_rule_factor_multiplies():
    def rule(s: int) -> float:  # BSP's lr_scaling: linear to 4 ranks over 40 steps
        return 1 + 3 * min(1.0, s / 40)

    opt = optimizer()
    schedule = CASES[2][0].build(opt, TOTAL, rule_factor=rule)
    for s in range(TOTAL):
        schedule.apply(s)
        expected = [lr * cosine(s) * rule(s) for lr in LRS]
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_rate_depends_on_the_step_alone():
    """Resuming needs no schedule state: any order of steps, or a new schedule, sets the same rates."""
    first = CASES[1][0].build(optimizer(), TOTAL)
    for s in (5, 90, 3, 119, 60):
        first.apply(s)
    fresh_opt = optimizer()
    fresh = CASES[1][0].build(fresh_opt, TOTAL)
    fresh.apply(60)
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in first.optimizer.param_groups]


def test_a_replanned_run_decays_over_its_new_length():
    """Survivors of a lost worker run longer: from the replan on, the rate is the schedule's over the new
    length (before it, the old length's), so it does not sit at the floor past the planned end."""
    cfg = CosineConfig()
    schedule = cfg.build(optimizer(), TOTAL)
    assert schedule.lr(TOTAL + 10) == [0.0] * len(LRS), "past its end a schedule stays at its floor"
    schedule.replan(TOTAL + 20)
    for s in (0, TOTAL, TOTAL + 10, TOTAL + 19):
        expected = [lr * cfg.factor(s, TOTAL + 20) for lr in LRS]
        assert schedule.lr(s) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert 0 < schedule.lr(TOTAL + 19)[0] < 0.01 * LRS[0]


@pytest.mark.parametrize(
    "total,pct_start,div,final_div",
    [
        (120, 0.3, 25.0, 1e4),
        (37, 0.25, 10.0, 100.0),
        (10, 0.5, 4.0, 1.0),
        (3, 0.3, 25.0, 1e4),
        (1, 0.3, 25, 1e4),
    ],
)
def test_onecycle_is_torchs_onecyclelr(total, pct_start, div, final_div):
    cfg = OneCycleConfig(pct_start=pct_start, div_factor=div, final_div_factor=final_div)
    ours = cfg.build(optimizer(), total)
    ref_opt = optimizer()
    ref = torch.optim.lr_scheduler.OneCycleLR(
        ref_opt,
        max_lr=LRS,
        total_steps=total,
        pct_start=pct_start,
        div_factor=div,
        final_div_factor=final_div,
        anneal_strategy="cos",
        cycle_momentum=False,
    )
    for s in range(total):
        assert ours.lr(s) == pytest.approx([g["lr"] for g in ref_opt.param_groups], rel=1e-12), s
        ref_opt.step()
        ref.step()
    assert max(ours.lr(s)[0] for s in range(total)) <= LRS[0] * (1 + 1e-12)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["schedule.warmup_steps=-1"], "schedule.warmup_steps=-1 is invalid"),
        (["schedule.warmup_start=1.0"], "schedule.warmup_start=1.0 is invalid"),
        (["schedule=step"], "schedule.milestones: no value given"),
        (["schedule=step", "schedule.milestones=[]"], "schedule.milestones=[] is invalid"),
        (["schedule=step", "schedule.milestones=[30,20]"], "schedule.milestones=[30, 20] is invalid"),
        (["schedule=step", "schedule.milestones=[10]", "schedule.warmup_steps=10"], "after the warm-up"),
        (["schedule=step", "schedule.milestones=[10]", "schedule.gamma=0"], "schedule.gamma=0.0 is invalid"),
        (["schedule=cosine", "schedule.min_factor=1.5"], "schedule.min_factor=1.5 is invalid"),
        (["schedule=onecycle", "schedule.warmup_steps=10"], "set schedule.pct_start instead"),
        (["schedule=onecycle", "schedule.pct_start=1"], "schedule.pct_start=1.0 is invalid"),
        (["schedule=onecycle", "schedule.div_factor=0.5"], "schedule.div_factor=0.5 is invalid"),
        (["schedule=onecycle", "schedule.final_div_factor=0"], "schedule.final_div_factor=0.0 is invalid"),
        (["schedule=cosine", "+schedule.warmup=5"], "did you mean schedule.warmup_steps"),
    ],
)
def test_bad_values_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("[", r"\[")):
        checked_config(overrides)


def test_default_is_constant_and_cosine_with_warmup_composes_and_builds():
    assert type(checked_config([]).schedule) is ConstantConfig
    cfg = checked_config(["schedule=cosine", "schedule.warmup_steps=50"])
    assert type(cfg.schedule) is CosineConfig and cfg.schedule.warmup_steps == 50
    opt = optimizer()
    cfg.schedule.build(opt, TOTAL).apply(75)
    factor = 0.5 * (1 + math.cos(math.pi * 25 / 70))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr * factor for lr in LRS])


def test_step_composes_with_milestones():
    cfg = checked_config(["schedule=step", "schedule.milestones=[3000,6000]", "schedule.gamma=0.2"])
    assert type(cfg.schedule) is StepConfig and cfg.schedule.milestones == [3000, 6000]
    assert cfg.schedule.factor(6000, 9000) == pytest.approx(0.04)
