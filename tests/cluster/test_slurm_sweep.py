"""A sweep sent to real Slurm with ``hydra/launcher=mpitrain_slurm``, as users run it: one allocation of
both nodes per point, the sweeping process on node 1 waiting for every point and writing the report.

The test nodes' Slurm keeps no accounting (no slurmdbd), so its real ``sacct`` fails ("Slurm accounting
storage is disabled") and the launcher reads the jobs' states from slurmctld (squeue): no sacct stand-in.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from runner.launcher.sweep_resume import point_state, read_manifest
from runner.run_folder import BINDINGS, CHECKPOINT_INDEX, CHECKPOINTS, SUMMARY
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


def files(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``folder``: its size, modification time (ns) and content."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def queued(c, env: dict[str, str]) -> list[str]:
    """The ids of the jobs slurmctld lists as pending or running."""
    done = c.run(0, ["squeue", "--noheader", "--format=%i", "--states=PD,R,CG,CF"], env=env, check=True)
    return done.stdout.split()


def test_a_slurm_sweep_cut_off_resumes_point_by_point(slurm_cluster, tmp_path):
    """A 3-point Slurm sweep (one point at a time, each on one node) whose sweeping process is killed and
    its Slurm jobs cancelled once point 0 has ended and point 1 has a checkpoint: ``resume=SWEEP_DIR``
    keeps point 0 as it is (the same files), resumes point 1 from its checkpoint (scancel's SIGTERM reached
    mpirun too, so its launcher wrote failed, with the signal: it was cut off, not failed) and runs point 2,
    through the same Slurm launcher, and writes one report over all three."""
    c = slurm_cluster
    env = {**c.slurm_env(), "PYTHONUNBUFFERED": "1"}
    sweep = tmp_path / "sweep"
    overrides = ["hydra/launcher=mpitrain_slurm", "hardware=slurm", "devices=1", "hydra.launcher.nodes=1"]
    overrides += [f"hydra.launcher.partition={c.partition}", "hydra.launcher.timeout_min=10", YIELD]
    overrides += ["hydra.launcher.array_parallelism=1", "model=mlp", "train.epochs=1", "train.log_every=5"]
    overrides += ["checkpoint.every=5", "simulate.straggler_ranks=[0]", "simulate.straggler_ms=100"]
    overrides += ["optim.lr=0.05,0.1,0.2"]
    log = (tmp_path / "first.log").open("w")
    first = c.popen(
        0, cli_argv(sweep, *overrides, multirun=True), env=env, stdout=log, stderr=log, start_new_session=True
    )
    index = sweep / "1" / CHECKPOINTS / CHECKPOINT_INDEX
    try:
        deadline = time.monotonic() + 120
        while not (index.is_file() and "step5" in index.read_text()):
            said = (tmp_path / "first.log").read_text()
            assert first.poll() is None and time.monotonic() < deadline, f"no checkpoint of point 1: {said}"
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the sweeping process; its Slurm jobs go on
        first.wait()
        log.close()
    jobs = queued(c, env)
    assert jobs, "point 1's job and point 2's should still be queued or running"
    c.run(0, ["scancel", *jobs], env=env, check=True)
    deadline = time.monotonic() + 60
    while queued(c, env):
        assert time.monotonic() < deadline, "the cancelled jobs did not end"
        time.sleep(0.5)
    assert json.loads((sweep / "0" / SUMMARY).read_text())["status"] == "ok"
    assert point_state(sweep / "1")[0] in ("preempted", "running"), point_state(sweep / "1")
    assert point_state(sweep / "2")[0] == "pending", point_state(sweep / "2")
    finished = files(sweep / "0")
    cut = json.loads(index.read_text())["checkpoints"][-1]  # the newest: what point 1 resumes from
    before = (sweep / "1" / "metrics.jsonl").read_text().splitlines()[: cut["metrics_lines"]]

    resume = [f"resume={sweep}", "train.progress=false", "hydra.launcher.array_parallelism=2"]
    done = c.run(0, [*cli_argv(sweep)[:3], *resume], env=env, timeout=180)  # points 1 and 2 at once
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "point 0 ok: kept as it is" in output, output
    assert re.search(r"point 1 (preempted|running): resumed from its checkpoint", output), output
    assert "point 2 pending: run" in output, output
    assert files(sweep / "0") == finished  # same files: sizes, times, contents
    for point, lr in (("0", 0.05), ("1", 0.1), ("2", 0.2)):
        summary = json.loads((sweep / point / SUMMARY).read_text())
        assert summary["status"] == "ok" and summary["swept"] == {"optim.lr": lr}, summary
    lines = (sweep / "1" / "metrics.jsonl").read_text().splitlines()
    assert lines[: len(before)] == before  # the first job's records up to its checkpoint, kept
    steps = [r["step"] for r in map(json.loads, lines) if r["kind"] == "step"]
    after = [r["step"] for r in map(json.loads, lines[len(before) :]) if r["kind"] == "step"]
    assert after and after[0] == cut["step"] + 5 and steps == sorted(set(steps)), (cut, steps)
    ends = [json.loads((sweep / p / SUMMARY).read_text())["steps"] for p in ("0", "1")]
    assert ends[0] == ends[1], ends  # resumed to the same end as point 0
    assert {n: p["state"] for n, p in read_manifest(sweep).items()} == dict.fromkeys("012", "ok")
    with open(sweep / "report.csv", newline="") as table:
        rows = {row["run"]: row["status"] for row in csv.DictReader(table)}
    assert rows == {"optim.lr=0.05": "ok", "optim.lr=0.1": "ok", "optim.lr=0.2": "ok"}, rows
