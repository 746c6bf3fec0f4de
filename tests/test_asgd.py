"""ASGD / Downpour in real mpirun jobs: one worker is plain SGD, sharding is exact, staleness is handled."""

from __future__ import annotations

import pytest

from tests.conftest import COMMON, assert_close, params_of, reference_params

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

NEVER = "rule.n_fetch=100000"


def test_one_worker_equals_single_process_sgd(cli):
    overrides = ["model=mlp", *COMMON]
    run = cli("rule=asgd", "devices=1", "train.batch_size=16", "train.save_model=all", *overrides)
    assert run.returncode == 0, run.output
    ref = reference_params(16, overrides)
    assert_close(params_of(run.dir / "model.pt"), ref, atol=1e-6)
    assert_close(params_of(run.dir / "model.rank0.pt"), ref, atol=1e-6)
    s = run.summary
    assert s["world_size"] == 2 and s["pushes"] == 6 and s["staleness_histogram"] == {"0": 6}


def test_two_servers_hold_the_same_parameters_as_one(cli):
    """Workers that never fetch follow a fixed schedule: the servers end at x0 + all pushed updates."""
    overrides = ["model=mlp", "rule=asgd", "devices=2", NEVER, *COMMON, "hardware.oversubscribe=true"]
    one, two = cli(*overrides, "rule.servers=1"), cli(*overrides, "rule.servers=2")
    assert one.returncode == 0 and two.returncode == 0, one.output + two.output
    assert two.summary["world_size"] == 4 and len(two.summary["server_versions"]) == 2
    assert_close(params_of(two.dir / "model.pt"), params_of(one.dir / "model.pt"), atol=1e-6)


def test_staleness_is_recorded_and_drop_drops_what_exceeds_the_bound(cli):
    overrides = ["model=mlp", "rule=asgd", "devices=2", NEVER, *COMMON, "hardware.oversubscribe=true"]
    accept = cli(*overrides)
    drop = cli(*overrides, "rule.staleness=drop", "rule.max_staleness=2")
    assert accept.returncode == 0 and drop.returncode == 0, accept.output + drop.output
    hist = {int(k): v for k, v in accept.summary["staleness_histogram"].items()}
    assert sum(hist.values()) == 2 * 6 and max(hist) >= 6, "without fetches staleness must grow"
    assert accept.summary["dropped_pushes"] == 0
    dropped = drop.summary
    stale = sum(v for k, v in dropped["staleness_histogram"].items() if int(k) > 2)
    assert dropped["dropped_pushes"] == stale > 0
    assert dropped["server_versions"] == [2 * 6 - stale]
    (final,) = drop.records("final")
    assert final["dropped_pushes"] == stale and final["server_versions"] == dropped["server_versions"]
