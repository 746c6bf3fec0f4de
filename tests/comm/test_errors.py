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
        with pytest.raises(PeerLost, match="barrier"):
            with faults(SimpleNamespace(tolerant=tolerant), "barrier"):
                raise MPI.Exception(MPI.ERR_PROC_FAILED)
