"""The counter of a fault-tolerant job across nodes (:class:`runner.comm.counter.ServedCounter`): the same
answers as the other counters, each call applied whole by its host's thread, and ranks killed while they
call hold up nobody (MPI's window counter, across nodes, left every survivor waiting for ever)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runner.comm.counter import ServedCounter
from tests.comm.test_file_counter import OneRank, answers_as_a_counter


@pytest.fixture
def counter():
    made = ServedCounter(OneRank(), slots=6)  # type: ignore[arg-type]
    yield made
    made.close()


def test_each_call_returns_the_value_before_it(counter):
    answers_as_a_counter(counter)


def test_the_host_thread_ends_when_the_counter_closes(counter):
    thread = counter._thread
    assert thread is not None and thread.is_alive()
    counter.close()
    assert not thread.is_alive() and counter._thread is None


@pytest.mark.slow
@pytest.mark.mpi
def test_under_mpi_ranks_killed_while_all_call_leave_the_others_drawing():
    """A real ULFM job of 4 ranks: ranks 1 and 2 are killed 0.3 and 0.6 s into a tight loop of calls from
    every rank, and ranks 0 (the host) and 3 go on drawing, each value once and in order, a second past
    the last kill (tests/helpers/counter_kill_job.py). Across nodes the job picks this counter (the cluster
    tier's ``test_ranks_killed_inside_counter_calls_across_nodes_hold_up_no_one``)."""
    from tests.conftest import ROOT, mpirun_argv

    job = str(ROOT / "tests" / "helpers" / "counter_kill_job.py")
    argv = mpirun_argv(4, "--with-ft", "ulfm", sys.executable, job, "0.3", "served")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert "survivors drew" in proc.stdout and "ServedCounter" in proc.stdout, proc.stdout + proc.stderr
