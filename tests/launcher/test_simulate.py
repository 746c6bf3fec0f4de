"""Simulated stragglers (``simulate.*``): the launcher's checks, and one real job with a slow rank."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from runner.launcher.launch import prepare
from runner.schema.config import validate
from tests.conftest import checked_config, compose_config


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["simulate.straggler_ms=-5"], "simulate.straggler_ms=-5.0 is invalid"),
        (["simulate.straggler_ms=nan"], "simulate.straggler_ms=nan is invalid"),
        (["simulate.straggler_ranks=[1,1]", "simulate.straggler_ms=5"], "name each rank once"),
        (["simulate.straggler_ranks=[2]", "simulate.straggler_ms=5"], "name ranks in 0..1 (devices=2)"),
        (["simulate.straggler_ranks=[-1]", "simulate.straggler_ms=5"], "simulate.straggler_ranks=[-1]"),
        (["simulate.jitter_ms=-1"], "simulate.jitter_ms=-1.0 is invalid"),
        (
            ["rule=asgd", "simulate.straggler_ranks=[2]", "simulate.straggler_ms=5"],
            "rank 2 is the rule's server",
        ),
        (
            ["rule=easgd", "rule.variant=async", "devices=3", "simulate.straggler_ranks=[3]"],
            "simulate.straggler_ranks=[3] is invalid: only workers may straggle",
        ),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(tmp_path, overrides, message):
    """The launcher's ``prepare`` refuses them, naming the key and the fix, before it writes the command."""
    with pytest.raises(ValueError, match=re.escape(message)):
        prepare(compose_config(overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "mpirun.txt").exists()


def test_a_wrong_type_fails_at_compose():
    with pytest.raises((ConfigCompositionException, ValidationError), match=r"simulate\.straggler_ms"):
        compose_config(["simulate.straggler_ms=slow"])


def test_defaults_and_a_straggler():
    assert checked_config().simulate.record() is None
    sim = checked_config(
        ["rule=asgd", "devices=3", "simulate.straggler_ranks=[0,2]", "simulate.straggler_ms=30"]
    )
    assert sim.simulate.record() == {"ranks": [0, 2], "ms": 30.0}
    assert [sim.simulate.delay_s(r) for r in range(4)] == [0.03, 0.0, 0.03, 0.0]


def test_jitter_gives_each_worker_its_own_fixed_delay_within_the_bound():
    sim = checked_config(["devices=4", "simulate.jitter_ms=20", "simulate.straggler_ranks=[1]",
                          "simulate.straggler_ms=30"]).simulate  # fmt: skip
    delays = [sim.delay_s(r) for r in range(4)]
    jitter = [d - (0.03 if r == 1 else 0.0) for r, d in enumerate(delays)]
    assert all(0 <= j <= 0.02 for j in jitter) and len(set(jitter)) == 4, delays
    assert delays == [sim.delay_s(r) for r in range(4)], "drawn once per worker, not per step"
    assert sim.record() == {"ranks": [1], "ms": 30.0, "jitter_ms": 20.0}
    assert checked_config(["simulate.jitter_ms=5"]).simulate.record() == {"jitter_ms": 5.0}


def test_spin_is_recorded_only_with_a_delay():
    spun = checked_config(["simulate.straggler_ranks=[1]", "simulate.straggler_ms=30", "simulate.spin=true"])
    assert spun.simulate.record() == {"ranks": [1], "ms": 30.0, "spin": True}
    assert checked_config(["simulate.spin=true"]).simulate.record() is None


@pytest.mark.parametrize("spin", [False, True])
def test_a_spun_delay_keeps_the_cpu_busy_and_a_slept_one_sleeps(monkeypatch, spin):
    """Spinning never sleeps and lasts the delay; sleeping hands the whole delay to ``time.sleep``."""
    from runner.rank import loop

    slept = []
    monkeypatch.setattr(loop.time, "sleep", slept.append)
    start = time.perf_counter()
    loop.delay(0.03, spin)
    assert slept == ([] if spin else [0.03])
    assert (time.perf_counter() - start >= 0.03) == spin


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["simulate.straggler_ranks=[1]"], "simulate.straggler_ms=0: no rank is slowed down"),
        (["simulate.straggler_ms=30"], "no simulate.straggler_ranks: no rank is slowed down"),
    ],
)
def test_half_a_setting_runs_unchanged_with_a_warning(caplog, overrides, message):
    """Accepted (a sweep over ``straggler_ms=0,30`` keeps its baseline point), but said."""
    with caplog.at_level(logging.WARNING, logger="runner"):
        checked = validate(compose_config(overrides))
    assert checked.simulate.record() is None and checked.simulate.delay_s(1) == 0.0
    assert message in caplog.text


def test_the_delay_opens_the_step_and_counts_in_its_measured_time():
    """The straggler's sleep comes before any of the step's work (the rule's first hook included) and
    inside the step's clock, as compute: no MPI, one rank, one step."""
    from runner.comm import CommStats
    from runner.rank.loop import Parts, Place, Records, Trainer
    from runner.rank.records.meter import Meter
    from runner.rank.state import Position
    from runner.rules.base import Rule, RuleContext
    from runner.schedule.constant import ConstantConfig
    from runner.schema.sections import TrainConfig
    from runner.tasks.classification import ClassificationConfig

    class Clocked(Rule):
        def before_step(self, step: int) -> None:
            self.started = time.perf_counter()

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = Clocked(RuleContext(SimpleNamespace(size=1), None, model, optimizer))
    stats, log = CommStats(), SimpleNamespace(write=lambda *a, **k: None)
    meter = Meter(stats, 1, 1, log, log_every=100, progress=False)
    task, schedule = ClassificationConfig().build(3), ConstantConfig().build(optimizer, 1)
    parts = Parts(model, optimizer, rule, task, schedule)
    place = Place(SimpleNamespace(stats=stats, rank=0, size=1), torch.device("cpu"), delay_s=0.05)
    trainer = Trainer(TrainConfig(), parts, (None, None), place, Records(log, meter, None, None))
    for x, y in meter.batches([(torch.randn(8, 4), torch.randint(0, 3, (8,)))]):
        called = time.perf_counter()
        assert trainer.step([(x, y)], Position())
        meter.step_done(1, 0, trainer.last_loss, len(x), 0.1)
    assert rule.started - called >= 0.05
    assert meter.epoch.compute >= 0.05 and meter.epoch.comm == 0.0


@pytest.mark.slow
@pytest.mark.mpi
def test_a_straggler_slows_every_step_and_is_recorded(cli):
    """Rank 1 sleeps 200 ms per step; under BSP rank 0 waits for it at every step. Each of steps 2..10 on
    rank 1 starts its sleep after rank 0 joined the previous step's all-reduce, so after rank 0's clock
    started: the validation after the last step comes at least 9 × 200 ms after the start, whatever the
    machine's speed. Without the delay, these 10 steps and the validation took 0.5 to 1.1 s on a loaded
    2-core machine: a delay of 30 ms would not tell the two apart there."""
    steps, ms = 10, 200
    run = cli(
        "train.epochs=1",
        f"train.max_steps={steps}",
        "simulate.straggler_ranks=[1]",
        f"simulate.straggler_ms={ms}",
        timeout=120,
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["straggler"] == {"ranks": [1], "ms": ms} and s["steps"] == steps
    (val,) = run.records("val")
    assert val["time"] >= (steps - 1) * ms / 1e3, val
    assert f"simulated stragglers: ranks [1] sleep {ms} ms per step" in run.output
