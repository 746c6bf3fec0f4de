"""A growth whose merge fails on one rank (``heal``; seen once in CI on 2 nodes: ``MPI_ERR_INTERN`` on rank
0): the others wait in the merge for good (ULFM's revoke does not end it, tried), so the job ends at once
with the cause named and how to continue, never a stall and never a bare MPI error."""

from __future__ import annotations

import time

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.mpi
def test_a_merge_that_fails_on_one_rank_ends_the_job_naming_it(tmp_path):
    t0 = time.monotonic()
    run = run_cli(
        tmp_path / "run",
        "hydra.searchpath=[file://tests/conf]",
        "model=dies",
        "devices=4",
        "hardware.oversubscribe=true",
        "hardware.fault_tolerance=heal",
        "rule=bsp",
        "train.epochs=2",
        "model.die_rank=3",
        "model.die_at=4",
        "model.merge_fails_rank=0",
        "train.stall_timeout=60",  # a stall ends the job (exit 4) after 60 s, not the test's timeout
        timeout=150,
    )
    wall = time.monotonic() - t0
    assert run.returncode == 1, run.output
    assert "rank 0 failed" in run.output and "MPI_Intercomm_merge of the new worker(s) returned" in run.output
    assert "resume=RUN_DIR" in run.output, run.output
    assert wall < 45, f"ended {wall:.0f} s after it started: a stall the watchdog ended?\n{run.output}"
    assert run.summary["status"] == "failed", run.summary
