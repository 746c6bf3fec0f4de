"""A sweep sent to real Slurm with ``hydra/launcher=mpitrain_slurm``, as users run it: one allocation of
both nodes per point, the sweeping process on node 1 waiting for every point and writing the report.

The test nodes' Slurm keeps no accounting (no slurmdbd), so its real ``sacct`` fails ("Slurm accounting
storage is disabled") and the launcher reads the jobs' states from slurmctld (squeue): no sacct stand-in.
"""

from __future__ import annotations

import csv
import json

import pytest

from runner.run_folder import BINDINGS, SUMMARY
from tests.cluster.nodes import SACCT_BIN
from tests.conftest import cli_argv

pytestmark = pytest.mark.cluster
pytest.importorskip(
    "hydra_plugins.hydra_submitit_launcher",
    reason='hydra-submitit-launcher is not installed: pip install -e ".[slurm]"',
)

#: 4 ranks on the nodes' 2 shared cores: ranks waiting in MPI yield instead of busy-polling.
YIELD = "+hardware.mca.mpi_yield_when_idle=1"


def test_a_slurm_sweep_ends_ok_with_every_point_in_its_report(slurm_cluster, tmp_path):
    """2 points × 4 ranks (2 a node, a task per rank): both train, the sweep exits 0 and its report has
    both, ok. (hydra-submitit-launcher's own launcher waits for a result from all 4 tasks of each job,
    where only task 0 runs the point: forever without accounting, else UncompletedJobError, exit 1.)"""
    c = slurm_cluster
    env = {**c.slurm_env(), "PYTHONUNBUFFERED": "1"}
    assert str(SACCT_BIN) not in env["PATH"].split(":"), "the real sacct, which has no accounting here"
    sweep = tmp_path / "sweep"
    overrides = ["hydra/launcher=mpitrain_slurm", "hardware=slurm", "devices=4", "hydra.launcher.nodes=2"]
    overrides += [f"hydra.launcher.partition={c.partition}", "hydra.launcher.timeout_min=10", YIELD]
    overrides += ["model=mlp", "train.epochs=1", "train.max_steps=8", "optim.lr=0.05,0.1"]
    done = c.run(0, cli_argv(sweep, *overrides, multirun=True), env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "asking slurmctld (squeue)" in output, output
    for point, lr in (("0", 0.05), ("1", 0.1)):
        summary = json.loads((sweep / point / SUMMARY).read_text())
        assert summary["status"] == "ok" and summary["world_size"] == 4, summary
        assert summary["swept"] == {"optim.lr": lr}
        hosts = {r["host"] for r in json.loads((sweep / point / BINDINGS).read_text())["ranks"]}
        assert hosts == set(c.names), hosts
    with open(sweep / "report.csv", newline="") as table:
        rows = {row["run"]: row["status"] for row in csv.DictReader(table)}
    assert rows == {"optim.lr=0.05": "ok", "optim.lr=0.1": "ok"}, rows
    report = (sweep / "report.md").read_text()
    assert "optim.lr=0.05" in report and "optim.lr=0.1" in report
