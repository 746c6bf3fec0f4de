"""The hardware package: one schema per option, the launch each plans, and the workers' placement report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import runner.hardware.base
from runner.hardware.cluster import ClusterConfig
from runner.hardware.cpu import CPUConfig
from runner.hardware.gpu import GPUConfig
from runner.hardware.mpirun import find_mpirun, mpi_flavor
from runner.rank.placement import check_bindings, place_rank, select_device
from runner.schema import schema_of
from tests.conftest import ROOT, compose_config
from tests.helpers.rules import rules


@pytest.mark.parametrize("module", ["cpu", "gpu", "cluster", "slurm"])
def test_each_option_module_holds_one_schema(module):
    cls = schema_of("hardware", module)
    assert issubclass(cls, runner.hardware.base.HardwareConfig) and cls.__module__.endswith(module)


@pytest.mark.parametrize("module", ["mpirun", "topology"])
def test_helper_modules_hold_no_schema(module):
    with pytest.raises(ValueError, match="found 0"):
        schema_of("hardware", module)


def test_the_launcher_and_the_hardware_package_import_no_torch_sklearn_or_mpi():
    sides = [ROOT / "runner" / side for side in ("launcher", "schema", "hardware")]
    found = sorted(p.relative_to(ROOT).with_suffix("") for side in sides for p in side.glob("*.py"))
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    except ImportError:  # the slurm extra is not installed: its sweep launcher cannot be imported
        found = [p for p in found if p.name != "slurm_sweep"]
    imports = ", ".join(".".join(p.parts).removesuffix(".__init__") for p in found)
    assert "runner.launcher.cli" in imports and "runner.hardware.topology" in imports
    heavy = "('torch', 'sklearn', 'mpi4py', 'numpy')"
    code = f"import {imports}, sys; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture
def cores(monkeypatch):
    """Call with a count: this machine then has that many usable cores."""
    return lambda n: monkeypatch.setattr(runner.hardware.base, "usable_cores", lambda: n)


def test_this_machine_shares_its_cores_among_the_ranks(cores):
    cores(8)
    launch = CPUConfig(flavor="openmpi").plan_launch(2, Path("/run"))
    assert (launch.threads, launch.bind, launch.launcher, launch.placements) == (4, "core", "mpirun", None)
    assert Path(launch.argv[0]).name == "mpirun" and launch.argv[1:3] == ["-n", "2"]
    assert launch.argv[launch.argv.index("--map-by") + 1] == "slot:PE=4"
    assert launch.argv[-1] == "/run"
    crowded = CPUConfig(flavor="openmpi").plan_launch(4, Path("/run"))
    assert (crowded.threads, crowded.bind) == (2, "core")
    cores(2)
    oversubscribed = CPUConfig(flavor="openmpi", bind="numa", oversubscribe=True).plan_launch(4, Path("/run"))
    assert (oversubscribed.threads, oversubscribed.bind) == (1, "none")
    assert "--oversubscribe" in oversubscribed.argv


def test_more_ranks_than_cores_are_refused_unless_oversubscribe(cores):
    cores(2)
    assert CPUConfig(flavor="openmpi").plan_launch(2, Path("/run")).bind == "core", "one rank per core fits"
    with pytest.raises(ValueError) as refused:
        CPUConfig(flavor="openmpi").plan_launch(3, Path("/run"))
    message = str(refused.value)
    assert message.startswith("devices: the job needs 3 ranks") and "2 usable cores" in message
    assert "hardware.oversubscribe=true" in message
    assert (
        "--oversubscribe" in CPUConfig(flavor="openmpi", oversubscribe=True).plan_launch(3, Path("/run")).argv
    )


def test_a_cluster_refuses_more_ranks_than_its_slots(cores, tmp_path):
    cores(64)
    with pytest.raises(ValueError, match=r"needs 5 ranks .*hardware.hosts=\['a:2', 'b:2'\] have 4 slots"):
        ClusterConfig(flavor="openmpi", hosts=["a:2", "b:2"]).plan_launch(5, Path("/run"))
    assert ClusterConfig(flavor="openmpi", hosts=["a:2", "b:2"], oversubscribe=True).plan_launch(
        5, Path("/run")
    )
    counted = tmp_path / "counted"
    counted.write_text("a slots=2\n")
    with pytest.raises(ValueError, match=f"the hostfile {counted} has 2 slots"):
        ClusterConfig(flavor="openmpi", hostfile=str(counted)).plan_launch(3, Path("/run"))
    uncounted = tmp_path / "uncounted"
    uncounted.write_text("a\nb slots=1\n")
    assert ClusterConfig(flavor="openmpi", hostfile=str(uncounted)).plan_launch(16, Path("/run")), (
        "a host without slots= has as many as mpirun finds cores there: not checked"
    )


def test_devices_beyond_this_machine_are_refused_before_anything_starts(tmp_path):
    from runner.launcher.launch import prepare

    with pytest.raises(ValueError, match="hardware.oversubscribe=true"):
        prepare(compose_config(["devices=1000"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    prepare(compose_config(["devices=1000", "hardware.oversubscribe=true"]), tmp_path / "ok")
    assert "--oversubscribe" in (tmp_path / "ok" / "mpirun.txt").read_text()


def test_a_cluster_shares_its_hosts_slots(cores, tmp_path):
    cores(2)
    launch = ClusterConfig(flavor="openmpi", hosts=["node1:4", "node2:4"]).plan_launch(4, Path("/run"))
    assert launch.threads == 2 and "--oversubscribe" not in launch.argv
    assert launch.argv[launch.argv.index("--host") + 1] == "node1:4,node2:4"
    empty = tmp_path / "hosts"
    empty.write_text("# no hosts yet\n")
    assert ClusterConfig(hostfile=str(empty)).cores() == 2, "no slots in the hostfile: this machine's cores"


def test_gpu_defaults():
    assert (GPUConfig().device, GPUConfig().bind) == ("cuda", "numa")


def test_mpirun_discovery_and_flavor(tmp_path):
    with pytest.raises(ValueError, match="hardware.mpirun='/nonexistent/mpirun' was not found"):
        find_mpirun("/nonexistent/mpirun")
    mpirun = find_mpirun(None)
    assert os.access(mpirun, os.X_OK) and mpi_flavor(mpirun) in ("openmpi", "mpich")
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'some other MPI 1.0'\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="hardware.flavor=openmpi|mpich"):
        mpi_flavor(str(fake))


def test_check_bindings():
    a = {"rank": 0, "host": "h", "cores": [0, 1], "numa": [0]}
    b = {"rank": 1, "host": "h", "cores": [1, 2], "numa": [1]}
    elsewhere = {**b, "host": "g"}
    assert check_bindings([a, b], "none", None) == []
    assert check_bindings([a, elsewhere], "core", None) == []
    assert check_bindings([a, b], "core", None) == [
        "ranks 0 and 1 share core 1 on h although hardware.bind=core"
    ]
    plan = [{"numa": 0, "gpu": 0}, {"numa": 0, "gpu": 1}]
    assert check_bindings([a, elsewhere], "numa", plan) == [
        "rank 1 runs on NUMA node(s) [1], planned: 0 (GPU 1)"
    ]


class OneRank:
    """The communicator of a job of one rank."""

    rank, size = 0, 1

    def local_rank(self) -> int:
        return 0

    def local_size(self) -> int:
        return 1

    def allgather_object(self, obj):
        return [obj]


def test_place_rank_reports_and_records_the_binding(tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        device, binding = place_rank(CPUConfig(threads_per_rank=1), OneRank(), tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert device == torch.device("cpu") and binding["gpu"] is None and binding["threads"] == 1
    assert binding["cores"] == sorted(os.sched_getaffinity(0)) and binding["pid"] == os.getpid()
    assert capsys.readouterr().out.startswith(f"rank 0/1 on {binding['host']}, cores {binding['cores']}")
    report = json.loads((tmp_path / "bindings.json").read_text())
    assert report == {"ranks": [binding], "plan": None, "problems": []}


def test_place_rank_warns_when_a_rank_is_off_its_plan(tmp_path, capsys):
    import torch

    (tmp_path / "plan.json").write_text(json.dumps([{"rank": 0, "numa": 7, "cpus": [0], "gpu": None}]))
    threads = torch.get_num_threads()
    try:
        place_rank(CPUConfig(threads_per_rank=1), OneRank(), tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert "warning: rank 0 runs on NUMA node(s)" in capsys.readouterr().err
    assert json.loads((tmp_path / "bindings.json").read_text())["problems"]


def test_cuda_without_torch_cuda_fails_the_rank(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="torch sees no CUDA device; use hardware=cpu"):
        select_device(GPUConfig(), OneRank(), tmp_path)


def test_config_yaml_records_the_plan_and_loads_back(cores, tmp_path):
    from runner.launcher.launch import prepare
    from runner.schema.config import load

    cores(8)
    argv = prepare(compose_config(["hardware.bind=numa", "hardware.flavor=openmpi"]), tmp_path)
    assert (tmp_path / "mpirun.txt").read_text().split()[0] == argv[0]
    checked = load(str(tmp_path / "config.yaml"))
    assert isinstance(checked.hardware, CPUConfig)
    assert (checked.hardware.threads_per_rank, checked.hardware.bind) == (4, "numa")
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("rule", rules())
def test_a_failure_summary_names_the_rule(tmp_path, rule):
    from runner.launcher.launch import write_failure_summary

    write_failure_summary(compose_config([f"rule={rule}"]), tmp_path, "diverged", "rank 1 failed", 1.5)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["rule"], summary["status"], summary["exit_status"]) == (rule, "diverged", 3)


def test_slurm_takes_more_ranks_than_tasks_only_when_told(monkeypatch, tmp_path):
    from runner.hardware.slurm import SlurmConfig

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_CPUS_PER_NODE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"needs 3 ranks .*hardware.oversubscribe=true"):
        SlurmConfig(flavor="openmpi").plan_launch(3, tmp_path)
    assert (
        "--oversubscribe" in SlurmConfig(flavor="openmpi", oversubscribe=True).plan_launch(3, tmp_path).argv
    )
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert "--overcommit" in SlurmConfig(oversubscribe=True).plan_launch(3, tmp_path).argv, "srun's own flag"
