"""hardware=slurm (the allocation read from SLURM_*, the mpirun or srun command) and sweeps through submitit.

There is no Slurm here: allocations are described by the environment variables Slurm sets, and the
submission is stopped at a stand-in ``sbatch`` that keeps the batch script it was given.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from runner.hardware.slurm import SlurmConfig, allocation, expand_counts
from runner.launcher.launch import prepare
from runner.schema.config import load
from tests.conftest import ROOT, compose_config, plain_mpirun_argv

#: An sbatch script with 2 nodes x 4 tasks x 2 CPUs, as Slurm describes it to the script.
BATCH = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
    "SLURM_CPUS_PER_TASK": "2",
}
#: The same allocation seen from inside a job step (a process that srun started).
STEP = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}


@pytest.fixture
def slurm_env(monkeypatch):
    """Call with a dict of SLURM_* variables: this test then runs 'inside' that allocation."""
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)

    def enter(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return enter


@pytest.mark.parametrize(
    "text, counts",
    [("16", [16]), ("4(x2)", [4, 4]), ("4(x2),2", [4, 4, 2]), ("1,3(x3)", [1, 3, 3, 3])],
)
def test_slurm_count_lists(text, counts):
    assert expand_counts(text) == counts


def test_bad_count_list_is_named():
    with pytest.raises(ValueError, match="4x2"):
        expand_counts("4x2")


def test_allocation_from_the_environment():
    alloc = allocation(BATCH)
    assert (alloc.job_id, alloc.nodes, alloc.tasks, alloc.cpus, alloc.cpus_per_task) == ("4242", 2, 8, 16, 2)
    assert not alloc.in_step and not alloc.gpus
    assert allocation(STEP).in_step
    assert not allocation({**BATCH, "SLURM_STEP_ID": str(0xFFFFFFFB)}).in_step, "the batch script's step"
    assert allocation({"SLURM_JOB_ID": "1", "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_JOB_CPUS_PER_NODE": "4"})
    assert allocation({}) is None


def test_mpirun_in_a_batch_script_takes_the_allocation(slurm_env, tmp_path):
    slurm_env(BATCH)
    argv = prepare(compose_config(["hardware=slurm", "devices=8"]), tmp_path)
    assert Path(argv[0]).name == "mpirun" and argv[argv.index("-n") + 1] == "8"
    assert argv[argv.index("--map-by") + 1] == "slot:PE=2", "SLURM_CPUS_PER_TASK threads per rank"
    assert "--host" not in argv and "--hostfile" not in argv and "--oversubscribe" not in argv
    assert "OMP_NUM_THREADS=2" in argv
    assert (tmp_path / "mpirun.txt").read_text().startswith(argv[0])


def test_srun_inside_a_job_step(slurm_env, tmp_path):
    """A sweep point started by srun (e.g. hydra/launcher=submitit_slurm): auto picks srun, with --overlap."""
    slurm_env(STEP)
    argv = prepare(compose_config(["hardware=slurm", "devices=4", "hardware.bind=numa"]), tmp_path)
    worker = argv.index("env")
    assert argv[:worker] == [
        "srun",
        "--mpi=pmix",
        "--ntasks=4",
        "--cpus-per-task=2",
        "--cpu-bind=ldoms",
        "--kill-on-bad-exit=1",
        "--unbuffered",
        "--overlap",
    ]
    assert argv[worker + 1 : worker + 3] == ["OMP_NUM_THREADS=2", "PYTHONUNBUFFERED=1"]
    assert argv[-3:] == ["-m", "runner.rank.worker", str(tmp_path)]


def test_srun_in_a_batch_script_when_asked(slurm_env, tmp_path):
    slurm_env({**BATCH, "SLURM_CPUS_PER_TASK": ""})
    overrides = ["hardware=slurm", "devices=4", "hardware.launcher=srun", "hardware.srun_mpi=pmix_v4"]
    argv = prepare(compose_config(overrides), tmp_path)
    assert argv[:3] == ["srun", "--mpi=pmix_v4", "--ntasks=4"] and "--overlap" not in argv
    assert "--cpus-per-task=4" in argv, "16 CPUs / 4 ranks when Slurm gives no CPUs per task"


@pytest.mark.parametrize(
    "env, overrides, message",
    [
        ({}, ["hardware=slurm"], "SLURM_JOB_ID is not set"),
        (BATCH, ["hardware=slurm", "devices=9"], r"devices: the job needs 9 ranks .* 8 task"),
        (STEP, ["hardware=slurm", "devices=4", "hardware.threads_per_rank=8"], "need 32 CPUs"),
        (STEP, ["hardware=slurm", "hardware.launcher=mpirun"], "launcher=srun or auto"),
        (STEP, ["hardware=slurm", "devices=4", "hardware.fault_tolerance=heal"], "heal needs mpirun"),
        (STEP, ["hardware=slurm", "hardware.fault_tolerance=continue"], "continue needs mpirun: under srun"),
        (BATCH, ["hardware=slurm", "hardware.launcher=srun", "hardware.fault_tolerance=continue"], "PMIx"),
    ],
)
def test_slurm_mistakes_are_refused_before_launch(slurm_env, tmp_path, env, overrides, message):
    slurm_env(env)
    with pytest.raises(ValueError, match=message):
        prepare(compose_config(overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "mpirun.txt").exists()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["hardware.launcher=srun"], "hardware.launcher"),
        (["hardware=slurm", "hardware.hosts=[a:2]"], "hardware.hosts"),
    ],
)
def test_slurm_keys_exist_only_under_hardware_slurm(overrides, key):
    """srun starts ranks only in an allocation (hardware=slurm), whose hosts Slurm gives: the other hardware
    options have no ``launcher``, and hardware=slurm has no ``hosts``, so Hydra refuses them."""
    with pytest.raises(ConfigCompositionException, match=key):
        compose_config(overrides)


def test_gpus_are_planned_only_on_a_single_node_started_by_mpirun(slurm_env, tmp_path, monkeypatch):
    """The launcher sees only the node it runs on: there it plans the GPUs, and refuses cuda without one;
    other nodes, or srun, place the ranks' GPUs themselves (each rank takes its node-local rank's)."""
    import runner.hardware.base
    from runner.hardware.topology import Topology

    no_gpu = Topology([0, 1, 2, 3], {}, {}, {0: [0, 1, 2, 3]})
    monkeypatch.setattr(runner.hardware.base, "read_topology", lambda: no_gpu)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    one_node = {"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2"}
    slurm_env({**one_node, "SLURM_JOB_CPUS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "2"})
    with pytest.raises(ValueError, match="hardware.device='cuda'.*no NVIDIA GPU.*hardware=cpu"):
        SlurmConfig(device="cuda", flavor="openmpi").plan_launch(2, tmp_path)
    launch = SlurmConfig(device="cuda", launcher="srun").plan_launch(2, tmp_path)
    assert launch.launcher == "srun" and launch.placements is None
    assert "--gpus-per-task=1" in launch.argv and "--gpu-bind=closest" in launch.argv
    slurm_env(BATCH)
    two_nodes = SlurmConfig(device="cuda", flavor="openmpi").plan_launch(8, tmp_path)
    assert two_nodes.launcher == "mpirun" and two_nodes.placements is None


def test_the_chosen_launcher_and_threads_are_recorded(slurm_env, tmp_path):
    """config.yaml holds what the launcher settled (srun, 2 threads, the binding), and loads back as Slurm."""
    slurm_env(STEP)
    prepare(compose_config(["hardware=slurm", "devices=4"]), tmp_path)
    hw = load(str(tmp_path / "config.yaml")).hardware
    assert isinstance(hw, SlurmConfig) and (hw.launcher, hw.threads_per_rank, hw.bind) == ("srun", 2, "core")
    direct = SlurmConfig().plan_launch(4, tmp_path)
    assert (direct.launcher, direct.threads, direct.bind) == ("srun", 2, "core")


def stand_in(folder: Path, name: str, script: str) -> None:
    """An executable ``folder/name`` (a stand-in for a Slurm command) running ``script``."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.slow
@pytest.mark.mpi
def test_the_srun_command_starts_a_working_job(cli, tmp_path):
    """The srun command line, as built, trains: a stand-in ``srun`` keeps its arguments and starts the
    worker command after them (``env ... python -m runner.rank.worker RUN``) with our mpirun."""
    bin_dir = tmp_path / "bin"
    mpirun = plain_mpirun_argv(1)  # mpirun[2]: the rank count
    stand_in(
        bin_dir,
        "srun",
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"open({str(tmp_path / 'srun.args')!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        "args = sys.argv[1:]\n"
        "n = next(a.split('=')[1] for a in args if a.startswith('--ntasks='))\n"
        "env = {k: v for k, v in os.environ.items() if not k.startswith('SLURM_')}\n"
        f"mpirun = {mpirun!r}\n"
        "mpirun[2] = n\n"
        "os.execve(mpirun[0], mpirun + args[args.index('env'):], env)\n",
    )
    allocation_env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_JOB_CPUS_PER_NODE": "2"}
    env = {**os.environ, **allocation_env, "SLURM_STEP_ID": "0", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = cli("hardware=slurm", "train.epochs=2", env=env)
    assert run.returncode == 0, run.output
    assert (tmp_path / "srun.args").read_text().startswith("--mpi=pmix --ntasks=2 --cpus-per-task=1")
    assert (run.dir / "mpirun.txt").read_text().startswith("srun --mpi=pmix")
    assert run.summary["world_size"] == 2 and run.summary["final_val_acc"] > 0.9


def stand_in_slurm(folder: Path) -> dict[str, str]:
    """An environment whose ``sbatch`` keeps the batch script and refuses the job, and whose ``srun``
    exists (submitit looks for it)."""
    for name, body in {
        "sbatch": 'cp "$1" "$SBATCH_CAPTURE"; echo "sbatch: error: stand-in for the test" >&2; exit 1',
        "srun": "exit 1",
    }.items():
        stand_in(folder, name, f"#!/bin/sh\n{body}\n")
    return {
        **os.environ,
        "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}",
        "SBATCH_CAPTURE": str(folder / "job.sbatch"),
    }


@pytest.mark.slow
def test_a_sweep_sent_to_slurm_is_one_allocation_per_point(tmp_path):
    """The README's Slurm sweep: the batch script asks for the nodes and a task per rank, and runs the
    sweep point's Python directly (no srun step around it, so its mpirun can use the allocation)."""
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher",
        reason='hydra-submitit-launcher is not installed: pip install -e ".[slurm]"',
    )
    env = stand_in_slurm(tmp_path / "bin")
    argv = [sys.executable, "-m", "runner", "-m", "hydra/launcher=mpitrain_slurm"]
    argv += [f"hydra.sweep.dir={tmp_path / 'sweep'}", "hardware=slurm", "devices=8", "rule=easgd"]
    argv += ["hydra.launcher.nodes=2", "hydra.launcher.cpus_per_task=4", "hydra.launcher.timeout_min=30"]
    argv += ["rule.alpha=0.05,0.1", "optim.lr=0.01,0.1"]  # alpha <= 1/8 keeps 8 workers' center stable
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "stand-in for the test" in proc.stderr, proc.stdout + proc.stderr
    script = (tmp_path / "bin" / "job.sbatch").read_text()
    flags = dict(line.split("=", 1) for line in script.splitlines() if line.startswith("#SBATCH"))
    assert flags["#SBATCH --array"] == "0-3%4", "4 sweep points, one array task each"
    assert flags["#SBATCH --nodes"] == "2" and flags["#SBATCH --ntasks-per-node"] == "4"
    assert flags["#SBATCH --cpus-per-task"] == "4" and flags["#SBATCH --time"] == "30"
    command = script.split("# command", 1)[1].strip().splitlines()
    assert command[-1].startswith(f"{sys.executable} -u -m submitit.core._submit "), command
    assert not any(line.startswith("srun") for line in command)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_sweep_runs_through_submitits_local_executor_in_one_folder(tmp_path):
    """The sweep folder (Hydra's default, under the working folder) is resolved once, in the launcher: the
    points, run by submitit in other processes from pickled configs, land in it, not in folders of their
    own."""
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher",
        reason='hydra-submitit-launcher is not installed: pip install -e ".[slurm]"',
    )
    argv = [sys.executable, "-m", "runner", "-m", "hydra/launcher=submitit_local"]
    argv += ["rule=easgd", "rule.alpha=0.1,0.5", "train.epochs=1", "train.max_steps=4"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"], list(sweep.iterdir())
    alphas = []
    for point in ("0", "1"):
        summary = json.loads((sweep / point / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["devices"] == 2 and summary["rule"] == "easgd"
        alphas.append(OmegaConf.load(sweep / point / "config.yaml").rule.alpha)
    assert alphas == [0.1, 0.5], "each point ran its own alpha"
    assert list((sweep / ".submitit").glob("*/*_result.pkl")), "the points ran as submitit jobs"
