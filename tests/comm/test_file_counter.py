"""The counter of a fault-tolerant job on one node (:class:`runner.comm.counter.FileCounter`): each update is
atomic across processes, and a process killed while it holds the lock holds up nobody (Open MPI's window
counter would leave the others spinning for ever)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest

from runner.comm.counter import FileCounter


class OneRank:
    """The part of a communicator that making a counter uses, for one process (rank 0 of 1)."""

    rank, size, tolerant, saw_loss = 0, 1, True, False
    _c = SimpleNamespace(
        bcast=lambda obj, root: obj,
        Barrier=lambda: None,
        Dup=lambda: SimpleNamespace(Iprobe=lambda *args: False),  # (a served counter's own communicator)
    )


@pytest.fixture
def counter():
    made = FileCounter(OneRank(), slots=6)  # type: ignore[arg-type]
    yield made
    made.close()


def answers_as_a_counter(counter) -> None:
    """Each call of ``counter`` (6 slots, all zero) returns the value before it: any counter's contract."""
    assert counter.fetch_add() == 0 and counter.fetch_add(0, 5) == 1 and counter.read() == [6]
    assert counter.fetch_max(1, 7) == 0 and counter.fetch_max(1, 3) == 7 and counter.read(1) == [7]
    assert counter.compare_and_swap(2, 1, 9) == 0 and counter.read(2) == [0], "no swap when it differs"
    assert counter.compare_and_swap(2, 0, 9) == 0 and counter.read(2) == [9]
    counter.put(3, [4, 5, 6])
    assert counter.read(0, 6) == [6, 7, 9, 4, 5, 6] == counter.snapshot()


def test_each_update_returns_the_value_before_it(counter):
    answers_as_a_counter(counter)


def test_the_file_is_gone_once_made(counter):
    assert os.stat(f"/proc/self/fd/{counter._fd}").st_nlink == 0, "unlinked: nothing left behind"


def _draw(counter: FileCounter, times: int, out) -> None:
    out.send([counter.fetch_add() for _ in range(times)])


def test_draws_from_four_processes_are_each_dealt_once(counter):
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(4)]
    procs = [ctx.Process(target=_draw, args=(counter, 2000, w)) for _, w in pipes]
    for p in procs:
        p.start()
    drawn = [t for r, _ in pipes for t in r.recv()]
    for p in procs:
        p.join(30)
    assert sorted(drawn) == list(range(8000)), "a value drawn twice or skipped: an update was not atomic"
    assert counter.read() == [8000]


def _hold(counter: FileCounter, ready) -> None:
    with counter._locked() as slots:
        slots[0] += 1  # dies in the middle of an update, the lock held
        ready.send(True)
        time.sleep(60)


@pytest.mark.timeout(20)
def test_a_process_killed_while_it_holds_the_lock_holds_up_nobody(counter):
    ctx = multiprocessing.get_context("fork")
    ready, told = ctx.Pipe(duplex=False)
    holder = ctx.Process(target=_hold, args=(counter, told))
    holder.start()
    assert ready.poll(10) and ready.recv()
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    start = time.monotonic()
    assert counter.fetch_add() == 1 and counter.read() == [2]
    assert time.monotonic() - start < 5


@pytest.mark.slow
@pytest.mark.mpi
def test_under_mpi_a_rank_killed_while_all_draw_leaves_the_others_drawing():
    """A real ULFM job of 3 ranks on one node: the communicator picks the file counter, rank 1 is killed
    0.3 s into a tight loop of draws, and ranks 0 and 2 go on drawing (each value once, in order) a second
    past it (tests/helpers/counter_kill_job.py)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, mpirun_argv

    job = str(ROOT / "tests" / "helpers" / "counter_kill_job.py")
    argv = mpirun_argv(3, "--with-ft", "ulfm", sys.executable, job, "0.3", "auto")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert "survivors drew" in proc.stdout and "FileCounter" in proc.stdout, proc.stdout + proc.stderr
