"""What a job on two nodes survives: a node's ranks killed (continue, heal), a whole node lost, a link cut.

``hardware.fault_tolerance=continue`` (ULFM) survives lost ranks while Open MPI's daemon on their node
lives; a lost daemon (a whole node) ends any Open MPI 5.0 job, and the launcher must say so, naming the
node and its ranks. A cut link with ULFM's failure detector on looks to each side like the other side's
death: exactly one side may go on (runner/rank/fence.py), and the launcher must end although mpirun waits
for the daemon it cannot reach.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runner.run_folder import read_checkpoint_index
from tests.cluster.conftest import mpitrain
from tests.cluster.nodes import wait_for_step

pytestmark = pytest.mark.cluster

YIELD = "+hardware.mca.mpi_yield_when_idle=1"
#: ULFM's heartbeat failure detector, as a user turns it on (a boolean, as YAML writes it).
DETECTOR = [
    "+hardware.mca.mpi_ft_detector=true",
    "+hardware.mca.mpi_ft_detector_period=1",
    "+hardware.mca.mpi_ft_detector_timeout=4",
]


def after_step(run_dir: Path, step: int, action, *args) -> threading.Thread:
    """Call ``action(*args)`` once the job in ``run_dir`` has recorded training step ``step``."""

    def go() -> None:
        try:
            wait_for_step(run_dir, step, timeout=120)
        except Exception:  # the job ended first: the test's own assertions say so
            return
        action(*args)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def four_ranks(nodes) -> list[str]:
    """Two ranks on each of two nodes: ranks 0, 1 on node 1, ranks 2, 3 on node 2."""
    n1, n2 = nodes.names
    return ["devices=4", "hardware=cluster", f"hardware.hosts=[{n1}:2,{n2}:2]", YIELD]


def test_continue_goes_on_without_a_nodes_ranks(cluster, tmp_path):
    """Node 2's ranks are killed (its Open MPI daemon lives): the 2 survivors on node 1 are half of the job
    and hold rank 0, so they go on, and say which ranks on which node were lost."""
    run_dir = tmp_path / "run"
    after_step(run_dir, 4, cluster.kill_ranks, 1)
    run = mpitrain(
        cluster,
        run_dir,
        *four_ranks(cluster),
        "hardware.fault_tolerance=continue",
        "train.epochs=3",
        "train.log_every=1",
    )
    assert run.returncode == 0, run.output
    n2 = cluster.names[1]
    s = run.summary
    assert sorted((f["rank"], f["host"]) for f in s["failures"]) == [(2, n2), (3, n2)], s["failures"]
    assert s["workers_at_end"] == 2 and "partitioned" not in s
    assert f"rank 2 ({n2}), rank 3 ({n2}) lost at step" in run.output
    assert "continuing with 2 workers" in run.output
    assert json.loads((run_dir / "logs" / "lost.json").read_text()) == {"lost": [2, 3]}


def test_heal_replaces_a_nodes_ranks_on_a_node_with_free_slots(make_nodes, tmp_path):
    """Node 2's ranks are killed under heal: replacements are spawned at the next agreement into free
    slots, which are on node 3 (Open MPI 5.0 does not give a dead rank's slots back, and node 1's are
    taken), and the job ends with 4 workers."""
    nodes = make_nodes(3)
    n1, n2, n3 = nodes.names
    run_dir = tmp_path / "run"
    after_step(run_dir, 4, nodes.kill_ranks, 1)
    run = mpitrain(
        nodes,
        run_dir,
        "devices=4",
        "hardware=cluster",
        f"hardware.hosts=[{n1}:2,{n2}:2,{n3}:2]",
        YIELD,
        "hardware.fault_tolerance=heal",
        "train.epochs=6",
        "train.log_every=1",
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert sorted((f["rank"], f["host"]) for f in s["failures"]) == [(2, n2), (3, n2)], s["failures"]
    assert s["workers_at_end"] == 4, s
    assert len(s["joins"]) == 2 and {j["host"] for j in s["joins"]} == {n3}, s["joins"]
    assert all(j["rank"] >= 4 for j in s["joins"]), "ids are never reused"


def test_a_lost_node_is_named_with_its_ranks_and_the_resume_that_continues(make_nodes, tmp_path):
    """Node 2 dies whole (its ranks and Open MPI's daemon): Open MPI 5.0's runtime ends the job whatever
    the fault tolerance. The launcher says which node, which ranks, that continue/heal cannot survive a
    lost daemon, and how to go on; not 'exited 0 but wrote no summary.json'."""
    nodes = make_nodes(2)
    n1, n2 = nodes.names
    run_dir = tmp_path / "run"
    after_step(run_dir, 4, nodes.kill_node, 1)
    run = mpitrain(
        nodes,
        run_dir,
        "devices=2",
        "hardware=cluster",
        f"hardware.hosts=[{n1}:1,{n2}:1]",
        "hardware.fault_tolerance=continue",
        "checkpoint.every=2",
        "train.epochs=3",
    )
    assert run.returncode == 1, run.output
    s = run.summary
    assert s["status"] == "failed" and s["cause"] == f"node {n2} lost (its Open MPI daemon too)", s
    assert s["failed_rank"] == 1
    assert f"node {n2} lost (its Open MPI daemon too) with rank 1 on it" in run.output
    assert "survive lost ranks but not a lost node" in run.output
    latest = read_checkpoint_index(run_dir)[-1]["dir"]
    assert f"python -m runner resume={run_dir} continues from its checkpoint {latest}" in run.output
    assert "wrote no summary.json" not in run.output


def test_a_cut_link_lets_exactly_one_side_go_on_and_the_launcher_end(make_nodes, tmp_path):
    """The link to node 2 is cut with ULFM's detector on (turned on as `=true`, which Open MPI must
    receive as a value it accepts, or nothing is detected): node 2's side (half, without rank 0) stops
    without a checkpoint, naming the partition; node 1's goes on alone and keeps one consistent history
    in the run folder; the launcher ends within 18 s of the final summary although mpirun waits for node
    2's daemon forever (5 s of grace once every rank ended, 5 of SIGTERM: 11 s seen; 27 s when it waited 12 s
    from the summary whatever the ranks did, and for launch agents holding the job's output)."""
    nodes = make_nodes(2)
    n1, n2 = nodes.names
    run_dir = tmp_path / "run"
    after_step(run_dir, 4, nodes.cut, 1)
    first_summary: list[float] = []

    def watch() -> None:  # when rank 0's summary.json appears (the launcher rewrites it at its end)
        while not first_summary:
            if (run_dir / "summary.json").exists():
                first_summary.append(time.time())
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    run = mpitrain(
        nodes, run_dir, *four_ranks(nodes), "hardware.fault_tolerance=continue", *DETECTOR, "train.epochs=3"
    )
    ended = time.time()
    assert run.returncode == 0, run.output
    assert first_summary and ended - first_summary[0] <= 18, ended - (first_summary or [ended])[0]
    assert re.search(
        r"mpirun is still running \d+ s after the job wrote its summary.json and its ranks ended", run.output
    )
    s = run.summary
    assert sorted((f["rank"], f["host"]) for f in s["failures"]) == [(2, n2), (3, n2)], s["failures"]
    assert s["workers_at_end"] == 2 and sorted(map(int, s["partitioned"])) == [2, 3], s
    for rank in (2, 3):
        said = (run_dir / "logs" / f"rank{rank}.partitioned").read_text()
        assert said.startswith(f"partitioned: rank 2 ({n2}), rank 3 ({n2}) lost contact with {n1}"), said
    assert "stopped on the minority side of a partition" in run.output
    assert sorted(p.name for p in (run_dir / "logs").glob("generation.*")) == ["generation.1"]
    assert json.loads((run_dir / "logs" / "lost.json").read_text()) == {"lost": [2, 3]}
    entries = read_checkpoint_index(run_dir)
    seqs = [e["seq"] for e in entries]
    assert seqs == sorted(set(seqs)), "one checkpoint per number"
    assert all(e["world_size"] == 2 for e in entries), "only the side that went on checkpointed"
    on_disk = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert on_disk == sorted(e["dir"] for e in entries)
    for entry in entries:  # each checkpoint's parts are the 2 survivors', none of the cut side's
        parts = sorted(p.name for p in (run_dir / "checkpoints" / entry["dir"]).glob("rank*"))
        assert len(parts) == 2, (entry["dir"], parts)


#: Every rank all-reduces once and says so (a file); the survivors (ranks 0, 1) wait for the test to kill node
#: 2's ranks, all-reduce again and print what MPI answered, then leave without MPI_Finalize.
ALLREDUCE_AFTER_A_LOSS = """import os, sys, time
from pathlib import Path
import numpy as np
from mpi4py import MPI
comm, folder = MPI.COMM_WORLD, Path(sys.argv[1])
comm.Set_errhandler(MPI.ERRORS_RETURN)
buf = np.ones(int(sys.argv[2]), dtype=np.float32)
comm.Allreduce(MPI.IN_PLACE, buf)
(folder / f"ready.{comm.rank}").touch()
while not (folder / "killed").exists():
    time.sleep(0.05)
try:
    comm.Allreduce(MPI.IN_PLACE, buf)
    print(comm.rank, "ok", flush=True)
except MPI.Exception as e:
    print(comm.rank, "error", MPI.Get_error_string(e.Get_error_class()), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("floats", [1_000, 1_000_000])
def test_a_tolerant_jobs_all_reduce_reports_a_node_lost_before_it(cluster, tmp_path, floats):
    """With the collectives a tolerant job gets (hardware/mca.py: no coll/han), an all-reduce over a
    communicator that lost node 2's ranks fails at once on both survivors. Under coll/han both survivors'
    all-reduce returned success, a sum without the lost ranks."""
    from runner.hardware.mca import DEFAULT_MCA, render, tolerant
    from tests.cluster.test_nodes import MPIRUN

    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_AFTER_A_LOSS)
    hosts = ",".join(f"{name}:2" for name in cluster.names)
    argv = [MPIRUN, "--allow-run-as-root", "--with-ft", "ulfm", "--host", hosts, "-n", "4"]
    for key, value in tolerant({**DEFAULT_MCA, "mpi_yield_when_idle": 1}).items():
        argv += ["--mca", key, render(value)]
    proc = cluster.popen(0, [*argv, sys.executable, str(script), str(tmp_path), str(floats)], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready.*"))) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(cluster.kill_ranks(1, str(script))) == 2
    (tmp_path / "killed").touch()
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"mpirun still ran 60 s after the loss:\n{proc.communicate()[0][-3000:]}")
    answers = sorted(line for line in out.splitlines() if re.fullmatch(r"[01] (ok|error .*)", line))
    assert [a.split()[:2] for a in answers] == [["0", "error"], ["1", "error"]], out[-3000:]
