"""32 ranks on 16 nodes: the job at the largest size the test bed holds, with a worker lost on the last node.

Two jobs cover what a user at that size checks first: BSP's 32 workers under ``heal`` (the last worker
killed; a warm spare waiting in the free slot of the last node replaces it and the job ends with 32
workers again), and ASGD's 30 workers with 2 servers under ``continue`` (a worker on node 15 killed; 29
workers end it). The job is ``tests/cluster/many.py``'s (``benchmarks/many_ranks.py`` measures it at 4 to
64 ranks).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from runner.run_folder import BINDINGS
from tests.cluster.conftest import mpitrain
from tests.cluster.many import job, kill_rank
from tests.cluster.test_failures import after_step
from tests.cluster.test_nodes import mpirun_argv
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster

RANKS, NODES = 32, 16


def nodes_of(run_dir) -> Counter:
    """How many ranks the job placed on each node (as the ranks recorded it)."""
    return Counter(r["host"] for r in json.loads((run_dir / BINDINGS).read_text())["ranks"])


def test_bsp_on_32_ranks_heals_a_worker_killed_on_the_last_node(make_nodes, tmp_path):
    nodes = make_nodes(NODES)
    run_dir = tmp_path / "run"
    last = nodes.names[-1]
    after_step(run_dir, 6, kill_rank, nodes, NODES - 1, RANKS - 1)  # rank 31, the last worker
    run = mpitrain(
        nodes,
        run_dir,
        *job("bsp", RANKS, nodes.names, epochs=1, spare=1, stall_timeout=150),
        "hardware.fault_tolerance=heal",
        "hardware.spares=1",  # (launch rank 32, in the last node's free slot)
        timeout=300,
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert nodes_of(run_dir) == {name: 2 for name in nodes.names}
    assert [(f["rank"], f["host"]) for f in s["failures"]] == [(31, last)], s["failures"]
    assert [(j["rank"], j["host"]) for j in s["joins"]] == [(32, last)], s["joins"]
    assert s["workers_at_end"] == RANKS and s["status"] == "ok", s


def test_asgd_on_30_workers_and_2_servers_goes_on_without_a_killed_worker(make_nodes, tmp_path):
    """The servers are the last two ranks (node 16); rank 29, a worker on node 15, is killed.

    It hung in 2 runs of 7 while the dealer's counter was MPI's window (the survivors waited for a lock the
    dead worker held: test_ranks_killed_inside_counter_calls_across_nodes_hold_up_no_one), and went on 52-69 s
    after the kill in the others."""
    nodes = make_nodes(NODES)
    run_dir = tmp_path / "run"
    after_step(run_dir, 6, kill_rank, nodes, NODES - 2, 29)
    run = mpitrain(
        nodes,
        run_dir,
        *job("asgd", RANKS, nodes.names, epochs=1, stall_timeout=150),
        "hardware.fault_tolerance=continue",
        timeout=300,
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert nodes_of(run_dir) == {name: 2 for name in nodes.names}
    assert s["devices"] == RANKS - 2, s
    assert [(f["rank"], f["host"]) for f in s["failures"]] == [(29, nodes.names[-2])], s["failures"]
    assert s["workers_at_end"] == RANKS - 3 and s["status"] == "ok", s


def test_a_counter_across_nodes_serves_the_others_while_its_host_computes(cluster, tmp_path):
    """The dealer's and the board's counter is on worker 0: its other nodes' calls do not wait for it to
    enter MPI (a thread of it answers them; ASGD on 32 ranks spent 655 ms a step in the dealer once)."""
    argv = mpirun_argv(cluster, ROOT / "tests" / "helpers" / "counter_across.py", seconds=4)
    env = {**os.environ, **cluster.mpi_env(), "PYTHONPATH": str(ROOT)}
    done = cluster.run(0, argv, env=env, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "total 30" in done.stdout, done.stdout


@pytest.mark.parametrize("every", [0.3, 0.5])
def test_ranks_killed_inside_counter_calls_across_nodes_hold_up_no_one(cluster, every):
    """4 ranks on 2 nodes draw from rank 0's counter in a tight loop; ranks 1 and 2 are killed ``every`` and
    twice ``every`` seconds in. The survivors must draw on, each value once: the job's tolerant counter across
    nodes is served by a thread of its host (``ServedCounter``). MPI's window counter hung here in 3 runs of
    4, every survivor waiting in ``MPI_Fetch_and_op`` for a lock the dead held
    (tests/helpers/counter_kill_job.py)."""
    argv = mpirun_argv(cluster, ROOT / "tests" / "helpers" / "counter_kill_job.py", ranks_per_node=2)
    argv = [argv[0], "--with-ft", "ulfm", *argv[1:-1], str(every), "auto"]
    env = {**os.environ, **cluster.mpi_env(), "PYTHONPATH": str(ROOT)}
    done = cluster.run(0, argv, env=env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "survivors drew" in done.stdout and "ServedCounter" in done.stdout, done.stdout
