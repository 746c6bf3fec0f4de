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


def stepped(point: Path) -> bool:
    """Whether the point in folder ``point`` has trained a step (a step record in its metrics.jsonl)."""
    try:
        lines = (point / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return False
    return any(json.loads(line).get("kind") == "step" for line in lines if line.endswith("}"))


def test_one_sigint_stops_a_slurm_sweep_and_resume_finishes_it(slurm_cluster, tmp_path):
    """One SIGINT to a 4-point Slurm sweep stops it (exit 130, ``resume=`` last); that resume ends it ok.

    2 points at a time, each on one node: the SIGINT, once 0 and 1 have trained a step, reaches only the
    sweeping process (the points run under slurmd): 0 and 1 stop by reading ``sweep.stop`` in the shared
    folder, and Slurm never starts 2 and 3 (their pending array tasks cancelled)."""
    c = slurm_cluster
    env = {**c.slurm_env(), "PYTHONUNBUFFERED": "1"}
    sweep = tmp_path / "sweep"
    overrides = ["hydra/launcher=mpitrain_slurm", "hardware=slurm", "devices=1", "hydra.launcher.nodes=1"]
    overrides += [f"hydra.launcher.partition={c.partition}", "hydra.launcher.timeout_min=10", YIELD]
    overrides += ["hydra.launcher.array_parallelism=2", "model=mlp", "train.epochs=2", "train.log_every=1"]
    overrides += ["simulate.straggler_ranks=[0]", "simulate.straggler_ms=200", "optim.lr=0.05,0.1,0.2,0.4"]
    out = tmp_path / "first.log"
    with out.open("w") as log:
        first = c.popen(
            0,
            cli_argv(sweep, *overrides, multirun=True),
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while not (stepped(sweep / "0") and stepped(sweep / "1")):
            said = out.read_text()
            assert first.poll() is None and time.monotonic() < deadline, (
                f"points 0 and 1 trained no step: {said}"
            )
            time.sleep(0.1)
        assert not [p for p in "01" if (sweep / p / SUMMARY).exists()], "a point ended before the stop"
        os.killpg(first.pid, signal.SIGINT)
        sent = time.monotonic()
        code = first.wait(timeout=120)
        took, ended = time.monotonic() - sent, time.time()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    said = out.read_text()
    assert code == 130, said
    stopped = max((sweep / p / SUMMARY).stat().st_mtime for p in "01")  # (the running points' ends)
    print(f"the sweep exited {code} {took:.1f} s after the SIGINT, {ended - stopped:.1f} s after its points")
    assert ended - stopped < 25, said  # (not 15 s a cancelled point: submitit's wait for its result file)
    assert "--state=PENDING" in said, said  # the first stop cancels only the jobs Slurm has not started
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"]  # 2 and 3: no folder
    for point in ("0", "1"):
        summary = json.loads((sweep / point / SUMMARY).read_text())
        assert summary["status"] == "preempted", summary
    states = {n: p["state"] for n, p in read_manifest(sweep).items()}
    assert states == {"0": "preempted", "1": "preempted", "2": "pending", "3": "pending"}, states
    last = said.strip().splitlines()[-1]
    assert "0 of 4 points ok, 2 preempted, 2 not started" in last and f"resume={sweep}" in last, said
    deadline = time.monotonic() + 60
    while queued(c, env):  # (points 0 and 1 stopped of themselves, 2 and 3 were cancelled)
        assert time.monotonic() < deadline, "the sweep's jobs did not end"
        time.sleep(0.5)

    resume = [f"resume={sweep}", "train.progress=false"]
    done = c.run(0, [*cli_argv(sweep)[:3], *resume], env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "point 0 preempted: resumed from its checkpoint" in output, output
    assert "point 3 pending: run" in output, output
    assert {n: p["state"] for n, p in read_manifest(sweep).items()} == dict.fromkeys("0123", "ok")
    for point, lr in (("0", 0.05), ("1", 0.1), ("2", 0.2), ("3", 0.4)):
        summary = json.loads((sweep / point / SUMMARY).read_text())
        assert summary["status"] == "ok" and summary["swept"] == {"optim.lr": lr}, summary
