"""The counter of a fault-tolerant job across nodes (:class:`runner.comm.counter.ServedCounter`): the same
answers as the other counters, each call applied whole by its host's thread, and ranks killed while they
call hold up nobody (MPI's window counter, across nodes, left every survivor waiting for ever)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from runner.comm.counter import ServedCounter


class OneRank:
    """The part of a communicator that making a counter uses, for one process (rank 0 of 1)."""

    rank, size, tolerant, saw_loss = 0, 1, True, False
    _c = SimpleNamespace(Dup=lambda: SimpleNamespace(Iprobe=lambda *args: False))


@pytest.fixture
def counter():
    made = ServedCounter(OneRank(), slots=6)  # type: ignore[arg-type]
    yield made
    made.close()


def test_each_call_returns_the_value_before_it(counter):
    assert counter.fetch_add() == 0 and counter.fetch_add(0, 5) == 1 and counter.read() == [6]
    assert counter.fetch_max(1, 7) == 0 and counter.fetch_max(1, 3) == 7 and counter.read(1) == [7]
    assert counter.compare_and_swap(2, 1, 9) == 0 and counter.read(2) == [0], "no swap when it differs"
    assert counter.compare_and_swap(2, 0, 9) == 0 and counter.read(2) == [9]
    counter.put(3, [4, 5, 6])
    assert counter.read(0, 6) == [6, 7, 9, 4, 5, 6] == counter.snapshot()


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
