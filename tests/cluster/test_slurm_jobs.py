"""``hardware=slurm`` on a real Slurm (slurmctld and a slurmd per node): sbatch jobs with both launchers,
and ``fault_tolerance=continue`` in a Slurm job when a node's ranks are killed (under mpirun; refused
under srun, whose PMIx server ends the step at the first lost rank)."""

from __future__ import annotations

import json
import shlex
import sys
import threading
from pathlib import Path

import pytest

from runner.run_folder import BINDINGS, COMMAND
from tests.cluster.nodes import wait_for_step
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster


def sbatch(nodes, tmp_path: Path, *overrides: str, timeout: float = 150) -> tuple[int, str, Path]:
    """Submit ``python -m runner hardware=slurm devices=4 OVERRIDES`` on 2 nodes × 2 tasks from node 1 and
    wait for it (``sbatch --wait``); returns its exit status, its output and its run folder."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_dir, out = tmp_path / "run", tmp_path / "slurm.out"
    command = [
        sys.executable,
        "-m",
        "runner",
        f"hydra.run.dir={run_dir}",
        "hardware=slurm",
        "devices=4",
        "train.progress=false",
        "+hardware.mca.mpi_yield_when_idle=1",
        *overrides,
    ]
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --cpus-per-task=1\n"
        f"#SBATCH --output={out}\ncd {ROOT}\nexec {shlex.join(command)}\n"
    )
    proc = nodes.run(0, ["sbatch", "--wait", str(script)], env=nodes.slurm_env(), timeout=timeout)
    output = out.read_text() if out.exists() else ""
    return proc.returncode, f"{proc.stdout}{proc.stderr}\n{output}", run_dir


def ranks_by_host(run_dir: Path) -> dict[str, list[int]]:
    hosts: dict[str, list[int]] = {}
    for r in json.loads((run_dir / BINDINGS).read_text())["ranks"]:
        hosts.setdefault(r["host"], []).append(r["rank"])
    return hosts


def test_an_sbatch_job_starts_its_ranks_with_mpirun_on_the_allocation(slurm_cluster, tmp_path):
    """launcher auto in a batch script: mpirun, which starts its daemons through Slurm (no agent, no
    ssh) and binds 2 ranks to each allocated node."""
    status, output, run_dir = sbatch(slurm_cluster, tmp_path, "train.epochs=1")
    assert status == 0, output
    assert (run_dir / COMMAND).read_text().split()[0].endswith("mpirun")
    n1, n2 = slurm_cluster.names
    assert ranks_by_host(run_dir) == {n1: [0, 1], n2: [2, 3]}
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"


def test_an_sbatch_job_starts_its_ranks_with_srun_when_asked(slurm_cluster, tmp_path):
    """hardware.launcher=srun: one task per rank through Slurm's PMIx server, bound by Slurm."""
    status, output, run_dir = sbatch(slurm_cluster, tmp_path, "hardware.launcher=srun", "train.epochs=1")
    assert status == 0, output
    assert (run_dir / COMMAND).read_text().startswith("srun --mpi=pmix")
    n1, n2 = slurm_cluster.names
    assert ranks_by_host(run_dir) == {n1: [0, 1], n2: [2, 3]}


def test_continue_in_a_slurm_job_goes_on_without_a_nodes_ranks_and_srun_is_refused(slurm_cluster, tmp_path):
    """fault_tolerance=continue in a batch script: launcher auto takes mpirun (PRRTE carries ULFM), and
    when node 2's ranks are killed mid-run the survivors on node 1 go on to the end. Under srun, Slurm's
    PMIx server kills the whole step at the first lost rank (its error handler does), so srun with fault
    tolerance is refused before anything starts, saying why."""
    status, output, _ = sbatch(
        slurm_cluster,
        tmp_path / "srun",
        "hardware.launcher=srun",
        "hardware.fault_tolerance=continue",
    )
    assert status == 2, output
    assert "hardware.fault_tolerance=continue needs mpirun: under srun, Slurm's PMIx server" in output
    run_dir = tmp_path / "run"

    def kill() -> None:
        try:
            wait_for_step(run_dir, 4, timeout=120)
        except Exception:
            return
        slurm_cluster.kill_ranks(1)

    threading.Thread(target=kill, daemon=True).start()
    status, output, run_dir = sbatch(
        slurm_cluster, tmp_path, "hardware.fault_tolerance=continue", "train.epochs=3", "train.log_every=1"
    )
    assert status == 0, output
    assert (run_dir / COMMAND).read_text().split()[0].endswith("mpirun")
    s = json.loads((run_dir / "summary.json").read_text())
    n2 = slurm_cluster.names[1]
    assert sorted((f["rank"], f["host"]) for f in s["failures"]) == [(2, n2), (3, n2)], s
    assert s["status"] == "ok" and s["workers_at_end"] == 2
