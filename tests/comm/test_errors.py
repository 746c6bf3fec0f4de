"""A lost peer as one exception (:mod:`runner.comm.errors`): which errors of a communication call become
:class:`PeerLost`, under fault tolerance and without it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runner.comm.binding import MPI
from runner.comm.errors import PeerLost, faults

#: What a collective's data can hold where a peer died before writing its part (seen in CI: an allgather of
#: objects over the world, its server killed).
TORN = [b"\x80\x04Q.", b"\x80\x04\x95\x10\x00\x00", b""]


@pytest.mark.parametrize("data", TORN)
def test_an_object_that_does_not_unpickle_under_fault_tolerance_is_a_lost_peer(data):
    with pytest.raises(PeerLost, match=r"allgather_object: a received object did not unpickle \("):
        with faults(SimpleNamespace(tolerant=True), "allgather_object"):
            MPI.pickle.loads(data)


def test_without_fault_tolerance_or_outside_unpickling_the_error_is_kept():
    with pytest.raises(Exception) as raised:  # (the unpickling error itself)
        with faults(SimpleNamespace(tolerant=False), "allgather_object"):
            MPI.pickle.loads(TORN[0])
    assert not isinstance(raised.value, PeerLost)
    with pytest.raises(ValueError, match="a bug of ours"):
        with faults(SimpleNamespace(tolerant=True), "allgather_object"):
            raise ValueError("a bug of ours")


def test_ulfms_failure_classes_are_a_lost_peer_with_or_without_fault_tolerance():
    for tolerant in (True, False):
        comm = SimpleNamespace(tolerant=tolerant, saw_loss=False)
        with pytest.raises(PeerLost, match="barrier"):
            with faults(comm, "barrier"):
                raise MPI.Exception(MPI.ERR_PROC_FAILED)
        assert comm.saw_loss  # (its next agreement says so: Membership.meet)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_survivor_that_recovers_while_the_others_agree_shrinks_with_them(tmp_path):
    """A real ULFM job of 3 ranks on one node (tests/helpers/shrink_meets_job.py): rank 2 dies, rank 0
    revokes and shrinks while rank 1 agrees. ULFM's shrink is agreements on the communicator, and matched
    rank 1's: rank 0 finished a shrink rank 1 never began and waited for it on the new communicator while
    rank 1 waited in its own shrink (a stall). Every survivor now meets before it shrinks."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, mpirun_argv

    job = str(ROOT / "tests" / "helpers" / "shrink_meets_job.py")
    argv = mpirun_argv(3, "--with-ft", "ulfm", "--oversubscribe", sys.executable, job, str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the survivors stalled (60 s)")
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: 2 ranks, lost [2], ids [0, 1]", "rank 1: 2 ranks, lost [2], ids [0, 1]"], (
        proc.stdout + proc.stderr
    )
