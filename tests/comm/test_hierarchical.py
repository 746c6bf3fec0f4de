"""``hardware.hierarchical``: all-reduces across hosts reduce inside each host first
(runner/comm/routes/hierarchical.py), with the flat exchange's results; when the route is taken, when not."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from runner.comm.links import Links
from runner.comm.routes import ROUTES
from runner.comm.routes.hierarchical import Hierarchical, Hosts, library_does_it, settle
from runner.comm.stats import CommStats
from runner.hardware.cpu import CPUConfig
from tests.comm.test_comm import run_job
from tests.conftest import ROOT, mpirun_argv

JOB = ROOT / "tests" / "helpers" / "hierarchical_job.py"


@pytest.mark.parametrize(
    "make, hint",
    [
        (lambda: CPUConfig(hierarchical="yes"), "one of auto, on, off"),
        (lambda: CPUConfig(hierarchical="on", fault_tolerance="continue"), "fault tolerance changes them"),
    ],
)
def test_bad_values_are_refused_before_launch_naming_the_key(make, hint):
    with pytest.raises(ValueError, match=rf"hierarchical.*{hint}"):
        make()


def test_auto_is_the_default_and_stays_off_under_fault_tolerance():
    assert CPUConfig().hierarchical == "auto"
    assert CPUConfig(hierarchical="auto", fault_tolerance="heal").hierarchical == "auto"


def test_it_is_registered_once_before_mpi_itself():
    names = [name.rsplit(".", 1)[1] for name in ROUTES]
    assert names.count("Hierarchical") == 1 and names.index("Hierarchical") == names.index("MpiBuffers") - 1


def stand_in(size: int = 4, tolerant: bool = False, links: Links | None = None, dist=None):  # noqa: ANN001
    """A communicator that cannot do MPI: enough for the decisions made before asking where ranks are."""
    own = Hierarchical()
    return SimpleNamespace(
        rank=0,
        size=size,
        tolerant=tolerant,
        dist=dist,
        stats=CommStats(links=links),
        _c=None,
        own=own,
        route=lambda kind: own,
    )


@pytest.mark.parametrize(
    "comm, why",
    [
        (stand_in(size=1), "one worker"),
        (stand_in(tolerant=True), "members may change"),
        (stand_in(links=Links(2, 0.1, 0.0)), "links are emulated"),
        (stand_in(dist=SimpleNamespace(backend="gloo")), "torch.distributed"),
    ],
)
def test_where_it_cannot_apply_auto_is_off_and_on_says_why(comm, why):
    assert settle(comm, "auto") == "off" and settle(comm, "off") == "off"
    assert comm.own.hosts is None
    with pytest.raises(ValueError, match=rf"hardware.hierarchical=on: .*{why}.*hierarchical=auto"):
        settle(comm, "on")


@pytest.mark.parametrize(
    "sizes, applies, said",
    [
        ([4], False, "one host"),
        ([1, 1, 1], False, "3 hosts x 1 rank"),
        ([2, 3], True, "2 hosts of 2+3 ranks"),
    ],
)
def test_it_applies_only_with_several_hosts_and_several_ranks_on_one(sizes, applies, said):
    hosts = Hosts(None, sizes, None, None)
    assert (hosts.applies, hosts.describe()) == (applies, said)


def test_the_route_takes_nothing_of_a_communicator_it_was_not_settled_on():
    t = torch.ones(8)
    comm = stand_in()
    comm.buffers = SimpleNamespace(cuda_aware=False)
    route = comm.own
    assert not route.takes(comm, "allreduce", (t,), None)
    route.hosts = SimpleNamespace(mpi="old")  # made for a communicator since replaced
    comm._c = "new"
    assert not route.takes(comm, "allreduce", (t,), None)
    route.hosts.mpi = "new"
    assert route.takes(comm, "allreduce", (t,), None)
    assert not Hierarchical().takes(comm, "allreduce", (t,), None), "another communicator's route: not set"
    assert not route.takes(comm, "allreduce", (t,), torch.bfloat16)
    assert not route.takes(comm, "allreduce", (torch.ones(8, dtype=torch.int32),), None)
    assert route.performs("allreduce") and not route.performs("iallreduce")


@pytest.mark.parametrize(
    "library, env, does",
    [
        ("Open MPI v5.0.11, package: ...", {}, True),
        ("Open MPI v5.0.11", {"OMPI_MCA_coll": "^han"}, False),
        ("Open MPI v5.0.11", {"OMPI_MCA_coll": "^hcoll,han"}, False),
        ("Open MPI v5.0.11", {"OMPI_MCA_coll": "^hcoll"}, True),
        ("Open MPI v5.0.11", {"OMPI_MCA_coll": "tuned,basic,self"}, False),
        ("Open MPI v5.0.11", {"OMPI_MCA_coll_han_priority": "10"}, False),
        ("Open MPI v4.1.6", {}, False),
        ("MPICH Version: 4.2.0", {}, False),
    ],
)
def test_auto_leaves_the_exchange_to_open_mpi_5_where_coll_han_does_it(library, env, does):
    """Open MPI 5 selects coll/han across nodes (priority 35 over tuned's 30), which moves what this route
    does; excluded or outranked through hardware.mca (OMPI_MCA_* in the ranks), it does not."""
    why = library_does_it(env, library)
    assert (why is not None) == does, why
    assert why is None or "coll/han" in why


@pytest.mark.slow
@pytest.mark.mpi
#: A host of one rank beside hosts of two, three hosts (a ring between leaders, not a pair): one job of 5
#: ranks; each rank its own host, where the route is not taken. (2+2: the cluster test.)
@pytest.mark.parametrize("layout", ["1,2,2", "1,1,1"])
def test_results_equal_the_flat_exchange_on_pretend_hosts(layout):
    """Ranks on pretend hosts (a split by number instead of by shared memory): sum, mean, max and min of odd
    sizes equal MPI's own all-reduce to 1e-6, even and uneven hosts; one host, or one rank per host, is
    left flat (and ``on`` refused there)."""
    ranks = sum(map(int, layout.split(",")))
    proc = run_job(mpirun_argv(ranks, sys.executable, "-m", "mpi4py", str(JOB), layout))
    taken = len(layout.split(",")) > 1 and "1,1" not in layout
    expected = "hierarchical checks passed" if taken else "hierarchical: not taken"
    assert expected in proc.stdout, proc.stdout + proc.stderr
