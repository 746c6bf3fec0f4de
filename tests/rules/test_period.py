"""Period schedules (runner/rules/period.py): constant, listed and QSR rounds, in every periodic rule.

In process, rank by rank on tests/helpers/fakecomm.py: the schedule's arithmetic by hand; a constant schedule
and a one-length list are today's fixed period bit for bit; DiLoCo as local SGD follows BSP's parameter
averaging over the same listed rounds, and its exchanges fall on QSR's steps as the rate decays; the position
in the schedule resumes from a checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from runner.rules.bsp import BSPConfig
from runner.rules.diloco import DiLoCoConfig
from runner.rules.easgd import EASGDConfig
from runner.rules.period import Periods
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import assert_close, build, mlp, params, sgd
from tests.rules.test_diloco import batches

N, STEPS = 3, 14
LOCAL_SGD = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}


def ends(periods: Periods, steps: int, rates=None) -> list[int]:
    """The 0-based steps an exchange ends, given the rate at each step."""
    rates = rates or [0.1] * steps
    return [s for s in range(steps) if periods.due(s, rates[s])]


def test_the_schedules_by_hand():
    assert ends(Periods(DiLoCoConfig(inner_steps=3), 3), 10) == [2, 5, 8]
    listed = DiLoCoConfig(inner_steps=3, period_schedule="list", period_list=[2, 3])
    assert ends(Periods(listed, 3), 12) == [1, 4, 7, 10]
    qsr = DiLoCoConfig(inner_steps=2, period_schedule="qsr", qsr_alpha=0.3)
    # rates: 0.1 (peak, rounds of 2) then 0.05 from step 4: (0.3 / 0.05)² = 36 steps
    rates = [0.1] * 4 + [0.05] * 60
    assert ends(Periods(qsr, 2), 64, rates) == [1, 3, 5, 41]
    rising = [0.01 * (s + 1) for s in range(20)]  # a warm-up: rounds stay at the base
    assert ends(Periods(qsr, 2), 20, rising) == list(range(1, 20, 2))


@pytest.mark.parametrize(
    "cfg, key",
    [
        (dict(period_schedule="qsr"), "qsr_alpha"),
        (dict(qsr_alpha=0.2), "qsr_alpha"),
        (dict(period_schedule="list"), "period_list"),
        (dict(period_schedule="list", period_list=[3, 0]), "period_list"),
        (dict(period_list=[3]), "period_list"),
        (dict(period_schedule="cosine"), "period_schedule"),
    ],
)
def test_a_schedule_without_its_numbers_is_refused_naming_the_key(cfg, key):
    with pytest.raises(ValueError, match=key):
        DiLoCoConfig(**cfg)


def test_bsp_grads_mode_takes_no_schedule():
    with pytest.raises(ValueError, match="period_schedule.*mode=params"):
        BSPConfig(period_schedule="list", period_list=[2])
    BSPConfig(mode="params", period_schedule="list", period_list=[2])


def run(cfg, steps: int = STEPS, lr=lambda step: 0.1, cut: int | None = None):
    """Every rank trains ``steps`` steps (inner SGD, momentum 0.9, rate ``lr(step)``); with ``cut`` the rule
    is rebuilt from its state_dict (and the optimizer's) after step ``cut``: a resume. Per rank the
    parameters after each step's rule hook, and the rule."""

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=lr(0), momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        seen = []
        for step, (x, y) in enumerate(batches(comm.rank, steps)):
            for group in optimizer.param_groups:
                group["lr"] = lr(step)
            rule.before_step(step)
            optimizer.zero_grad()
            (F.cross_entropy(model(x), y) * rule.loss_scale).backward()
            rule.after_backward(step)
            optimizer.step()
            rule.after_step(step)
            seen.append(params(model))
            if step == cut:  # as a resume: the rule built anew, then the model and its state loaded
                state, weights = rule.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
                rule = build(comm, cfg, model, optimizer)
                model.load_state_dict(weights)
                rule.load_state_dict(state)
        return seen, rule

    return FakeWorld(N).run(main)


@pytest.mark.parametrize(
    "make",
    [
        lambda **k: DiLoCoConfig(inner_steps=3, **k),
        lambda **k: BSPConfig(mode="params", avg_freq=3, **k),
        lambda **k: EASGDConfig(alpha=0.2, tau=3, **k),
    ],
    ids=["diloco", "bsp-params", "easgd"],
)
def test_constant_and_a_one_length_list_are_the_fixed_period_bit_for_bit(make):
    fixed = run(make())
    listed = run(make(period_schedule="list", period_list=[3]))
    other = run(make(period_schedule="list", period_list=[2]))
    for (a, _), (b, _) in zip(fixed, listed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert (other[0][0][-1] - fixed[0][0][-1]).abs().max() > 1e-6, "another period would differ"


def test_diloco_as_local_sgd_follows_bsp_params_over_listed_rounds():
    """Rounds of 2, 5, then 3: DiLoCo (outer lr 1, no momentum) and BSP mode=params average on the same
    steps (1, 6, 9, 12), so their trajectories agree to float64 rounding; workers differ between."""
    listed = {"period_schedule": "list", "period_list": [2, 5, 3]}
    diloco = run(DiLoCoConfig(inner_steps=2, **LOCAL_SGD, **listed))
    bsp = run(BSPConfig(mode="params", avg_freq=2, **listed))
    for (d, _), (b, _) in zip(diloco, bsp, strict=True):
        for x, y in zip(d, b, strict=True):
            assert_close(x, y)
    together = [s for s in range(STEPS) if torch.equal(diloco[0][0][s], diloco[1][0][s])]
    assert together == [1, 6, 9, 12]
    assert diloco[0][1].metrics()["period"] == 3 and diloco[0][1].outer_steps == 4


def test_diloco_rounds_lengthen_by_qsr_as_the_rate_decays():
    """Rate 0.1 for 4 steps, then 0.05: the rounds that start at 0.1 last 2 steps (the last one starts at
    step 4, its rate fixed at step 3's end), the next one (0.3/0.05)² = 36."""
    cfg = DiLoCoConfig(inner_steps=2, period_schedule="qsr", qsr_alpha=0.3)
    ranks = run(cfg, steps=12, lr=lambda step: 0.1 if step < 4 else 0.05)
    together = [s for s in range(12) if torch.equal(ranks[0][0][s], ranks[2][0][s])]
    assert together == [1, 3, 5]  # (the round from step 6 ends at step 41)
    assert ranks[0][1].metrics()["period"] == 36


@pytest.mark.parametrize(
    "cfg",
    [
        DiLoCoConfig(inner_steps=2, period_schedule="list", period_list=[2, 5, 3]),
        BSPConfig(mode="params", avg_freq=2, period_schedule="list", period_list=[2, 5, 3]),
        EASGDConfig(alpha=0.2, tau=2, period_schedule="list", period_list=[2, 5, 3]),
    ],
    ids=["diloco", "bsp-params", "easgd"],
)
def test_the_schedule_resumes_where_it_stood(cfg):
    """Rebuilt from its state after step 4 (mid-round of 5), the rule exchanges where it would have."""
    whole = run(cfg)
    resumed = run(cfg, cut=4)
    for (a, _), (b, _) in zip(whole, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
