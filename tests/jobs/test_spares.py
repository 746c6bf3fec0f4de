"""Warm spares (``hardware.spares``, runner/comm/spares.py): real mpirun jobs in which a lost worker is
replaced by a spare launched with the job, not by a spawned process, and the spares left are released.

A spare keeps its launch rank as its id in the job (workers, servers, then spares), while a spawned worker
would take the next id after every launched rank: the join's id tells which of the two replaced the worker.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.jobs.test_elastic import HEAL as ELASTIC

HEAL = [*ELASTIC, "model.die_rank=2", "model.die_at=20"]


@pytest.mark.parametrize(
    "rule, overrides, servers",
    [("bsp", ["train.epochs=4", "schedule=cosine"], 0), ("asgd", ["train.epochs=4", "schedule=cosine"], 1)],
)
@pytest.mark.slow
@pytest.mark.mpi
def test_a_spare_replaces_a_killed_worker_and_the_other_is_released(tmp_path, rule, overrides, servers):
    """kill -9 of worker 2 with 2 spares: the first spare (id 4 + servers) joins, none is spawned, the job
    ends ok with 4 workers, and the second spare leaves when the job ends (its log says so)."""
    run = run_cli(tmp_path / "run", *HEAL, f"rule={rule}", "hardware.spares=2", *overrides, timeout=240)
    assert run.returncode == 0, run.output
    summary = run.summary
    first, second = 4 + servers, 5 + servers
    assert summary["status"] == "ok" and summary["workers_at_end"] == 4, summary
    assert [f["rank"] for f in summary["failures"]] == [2]
    assert [j["rank"] for j in summary["joins"]] == [first], "a spare joined, not a spawned worker"
    assert summary["world_size"] == 4 + servers, "the spares are not the job's ranks"
    logs = run.dir / "logs"
    assert "a spare on" in (logs / f"rank{first}.log").read_text()
    assert "joined the job at step" in (logs / f"rank{first}.log").read_text()
    assert "released: the job ended without needing it" in (logs / f"rank{second}.log").read_text()
    assert not (logs / f"rank{second + 1}.log").exists(), "nothing was spawned"
    assert summary["final_val_acc"] >= 0.9, summary
