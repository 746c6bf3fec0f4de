"""MCA options across nodes reach every node's ranks as Open MPI reads them, or the job does not start."""

from __future__ import annotations

import pytest

from runner.run_folder import COMMAND, MPIRUN_LOG
from tests.cluster.conftest import mpitrain

pytestmark = pytest.mark.cluster


def test_a_boolean_mca_option_reaches_open_mpi_on_every_node_and_a_bad_value_stops_the_launch(
    cluster, tmp_path
):
    """`=true` (YAML's boolean) used to reach mpirun as `True`, which Open MPI rejects with a box on each
    rank before running on without the option; now it is `true`, accepted on both nodes. A value Open MPI
    would reject ends the launch before any process starts, naming the key."""
    n1, n2 = cluster.names
    hosts = ["devices=2", "hardware=cluster", f"hardware.hosts=[{n1}:1,{n2}:1]"]
    bad = mpitrain(cluster, tmp_path / "bad", *hosts, "+hardware.mca.mpi_ft_detector=maybe", timeout=60)
    assert bad.returncode == 2, bad.output
    assert "hardware.mca.mpi_ft_detector" in bad.output and not (tmp_path / "bad" / MPIRUN_LOG).exists()
    run = mpitrain(
        cluster,
        tmp_path / "run",
        *hosts,
        "hardware.fault_tolerance=continue",
        "+hardware.mca.mpi_ft_detector=true",
        "+hardware.mca.mpi_yield_when_idle=true",
        "train.max_steps=4",
        timeout=120,
    )
    assert run.returncode == 0, run.output
    argv = (run.dir / COMMAND).read_text()
    assert "--mca mpi_ft_detector true" in argv and "--mca mpi_yield_when_idle true" in argv, argv
    log = (run.dir / MPIRUN_LOG).read_text(errors="replace")
    assert "invalid value" not in log and "mpi_ft_detector" not in log, log[-2000:]
