"""The mpirun command line built from the hardware group."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.hardware.cluster import ClusterConfig
from runner.hardware.cpu import CPUConfig
from runner.hardware.mpirun import build_argv, threads_per_rank
from runner.rank.resilience.elastic import PASSED_ENV
from runner.run_folder import OVERSUBSCRIBED_ENV


def argv(ranks=2, cores=2, as_root=False, flavor="openmpi", **hw):
    schema = ClusterConfig if "hosts" in hw or "hostfile" in hw else CPUConfig
    return build_argv(
        schema(**hw),
        ranks,
        Path("/run"),
        mpirun="mpirun",
        flavor=flavor,
        cores=cores,
        as_root=as_root,
        python="python",
    )


def flag_value(args, flag):
    return args[args.index(flag) + 1]


def test_core_binding_one_rank_per_core():
    a = argv(ranks=2, cores=2)
    assert a[:3] == ["mpirun", "-n", "2"]
    assert flag_value(a, "--map-by") == "core" and flag_value(a, "--bind-to") == "core"
    assert "--report-bindings" in a and "--oversubscribe" not in a
    assert a[-4:] == ["python", "-m", "runner.rank.worker", "/run"]
    assert "OMP_NUM_THREADS=1" in a


def test_several_cores_per_rank():
    a = argv(ranks=2, cores=8)
    assert flag_value(a, "--map-by") == "slot:PE=4" and flag_value(a, "--bind-to") == "core"
    assert "OMP_NUM_THREADS=4" in a
    assert threads_per_rank(CPUConfig(threads_per_rank=3), 2, 8) == 3


@pytest.mark.parametrize("bind,domain", [("numa", "numa"), ("socket", "package")])
def test_numa_and_socket_binding(bind, domain):
    a = argv(ranks=2, cores=8, bind=bind)
    assert flag_value(a, "--map-by") == domain and flag_value(a, "--bind-to") == domain


def test_more_ranks_than_cores_oversubscribes_without_binding():
    a = argv(ranks=4, cores=2)
    assert "--oversubscribe" in a
    assert flag_value(a, "--bind-to") == "none" and "--map-by" not in a and "--report-bindings" not in a


def test_oversubscribe_asked_for_is_passed_on_without_binding():
    """On a cluster whose hosts have more slots than cores, a core binding made mpirun refuse the job (64
    ranks on 16 namespaced nodes of 2 cores): asked for, oversubscription switches binding off."""
    a = argv(ranks=2, cores=2, oversubscribe=True)
    assert "--oversubscribe" in a and flag_value(a, "--bind-to") == "none"
    assert "--oversubscribe" not in argv(ranks=2, cores=2)
    hosts = argv(ranks=64, cores=64, hosts=[f"n{i}:4" for i in range(16)], oversubscribe=True)
    assert flag_value(hosts, "--bind-to") == "none"


@pytest.mark.parametrize("ranks, asked", [(4, False), (2, True)])
def test_an_oversubscribed_job_tells_its_ranks_so_that_their_spawns_may_share_cores(ranks, asked):
    """Open MPI does not pass ``--oversubscribe`` on to MPI_Comm_spawn: heal's replacement on a node with
    a free slot but no free core was refused (seen on the namespaced nodes)."""
    assert f"{OVERSUBSCRIBED_ENV}=1" in argv(ranks=ranks, cores=2, oversubscribe=asked)
    assert not any(OVERSUBSCRIBED_ENV in a for a in argv(ranks=2, cores=2))
    assert OVERSUBSCRIBED_ENV in PASSED_ENV  # and on to the workers spawned (one may spawn later)
    hosts = argv(ranks=4, cores=4, hosts=["a:2", "b.lan:2"], oversubscribe=True)
    assert f"{OVERSUBSCRIBED_ENV}=a,b.lan" in hosts  # heal's replacements go where mpirun knows the names


def test_bind_none():
    a = argv(bind="none")
    assert flag_value(a, "--bind-to") == "none" and "--map-by" not in a


def test_root_flag_only_as_root():
    assert "--allow-run-as-root" in argv(as_root=True)
    assert "--allow-run-as-root" not in argv(as_root=False)


def test_open_mpi_leaves_out_the_slow_libfabric_btl_unless_told():
    assert " ".join(argv()).count("--mca btl ^ofi") == 1
    assert "--mca btl self,sm,tcp,ofi" in " ".join(argv(mca={"btl": "self,sm,tcp,ofi"}))
    assert "--mca" not in argv(flavor="mpich")


def test_mca_env_and_extra_args():
    a = argv(mca={"coll_tuned_use_dynamic_rules": "1"}, env={"FOO": "bar"}, extra_args=["--tag-output"])
    i = a.index("--mca")
    assert a[i : i + 3] == ["--mca", "coll_tuned_use_dynamic_rules", "1"]
    assert a[a.index("FOO") - 1] == "-x" and "bar" not in a, "hardware.env by name: its value is a secret"
    assert "--tag-output" in a
    assert a.index("--tag-output") < a.index("python")


def test_mpich_flags():
    a = argv(ranks=4, cores=2, flavor="mpich", as_root=True)
    assert "--oversubscribe" not in a and "--allow-run-as-root" not in a
    assert flag_value(a, "-bind-to") == "none"
    b = argv(ranks=2, cores=4, flavor="mpich")
    assert flag_value(b, "-bind-to") == "core:2" and flag_value(b, "-map-by") == "core"
    assert b[b.index("-genv") : b.index("-genv") + 3] == ["-genv", "OMP_NUM_THREADS", "2"]


def test_hosts_and_hostfile(tmp_path):
    a = argv(ranks=4, cores=4, hosts=["node1:2", "node2:2"])
    assert flag_value(a, "--host") == "node1:2,node2:2" and "--oversubscribe" not in a
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=4  # first\nnode2 slots=4\n\n")
    assert ClusterConfig(hostfile=str(hostfile)).slots() == 8
    assert ClusterConfig(hosts=["a", "b:3"]).slots() == 4
    assert flag_value(argv(hostfile=str(hostfile)), "--hostfile") == str(hostfile)
    assert flag_value(argv(flavor="mpich", hosts=["a:1", "b:1"]), "-hosts") == "a:1,b:1"
    assert flag_value(argv(flavor="mpich", hostfile=str(hostfile)), "-f") == str(hostfile)
    assert "--host" not in argv() and "-hosts" not in argv(flavor="mpich"), "this machine: no hosts"


def test_open_mpi_s_tcp_btl_goes_without_its_put_unless_told():
    """With put, the two directions of a ring all-reduce over TCP took turns (benchmarks/README.md)."""
    assert " ".join(argv()).count("--mca btl_tcp_flags 57") == 1
    assert "--mca btl_tcp_flags 59" in " ".join(argv(mca={"btl_tcp_flags": 59}))
