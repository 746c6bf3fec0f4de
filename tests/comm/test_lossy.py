"""The in-process ULFM of the randomized kill test (tests/helpers/lossy.py) keeps ULFM's promises: a loss
fails the collectives it is missing from on every survivor, revoke reaches every survivor, the agreement
fails on all alike, and shrink renumbers the living in order."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from runner.comm.errors import PeerLost
from tests.helpers.lossy import Killed, LossyWorld


def test_a_collective_missing_a_dead_rank_fails_on_every_survivor_and_shrink_renumbers():
    """Rank 1 dies entering its second all-reduce: the first completes everywhere, the second fails on
    ranks 0, 2 and 3, which shrink to ranks 0, 1, 2 (ids 0, 2, 3) and all-reduce among themselves."""

    def main(comm):
        t = torch.ones(2)
        comm.allreduce(t)
        try:
            comm.allreduce(torch.ones(2))
            return "went on"
        except PeerLost:
            comm.revoke()
            lost = comm.shrink()
        total = comm.allreduce(torch.full((1,), float(comm.launch_rank())))
        return t.tolist(), lost, comm.rank, comm.size, total.item()

    world = LossyWorld(4, deaths={1: 2})
    out = world.run(main)
    assert isinstance(out[1], Killed)
    assert [out[r] for r in (0, 2, 3)] == [([4.0, 4.0], [1], r, 3, 5.0) for r in (0, 1, 2)]


def test_revoke_fails_a_survivor_that_waits_for_a_message_and_agree_fails_alike():
    """Rank 2 dies at once; rank 0 notices in a collective and revokes, which frees rank 1 from a receive
    that would never complete; afterwards the agreement raises on both, then passes once they shrank."""

    def main(comm):
        seen = []
        try:
            if comm.rank == 1:
                comm.recv(torch.zeros(1), source=0, tag=7)
            else:
                comm.barrier()
        except PeerLost:
            seen.append("lost")
            comm.revoke()
        try:
            comm.agree()
        except PeerLost:
            seen.append("agree failed")
        comm.shrink()
        comm.agree()
        return seen

    out = LossyWorld(3, deaths={2: 1}).run(main, timeout=10)
    assert out[:2] == [["lost", "agree failed"]] * 2


def test_a_survivor_that_shrinks_while_another_agrees_ends_in_the_same_communicator():
    """ULFM's shrink is agreements of the same sequence as ``MPI_Comm_agree``'s. Rank 2 dies and both
    survivors acknowledge it; rank 0 revokes and shrinks while rank 1 agrees (the loop's settle). Without a
    meeting before the shrink, rank 1's agreement met rank 0's shrink and succeeded, rank 1 went on, failed
    on the revoked communicator and shrank, and each waited for the other (as a real job did:
    tests/comm/test_errors.py). Now rank 1's agreement fails, and both shrink together."""

    def main(comm):
        if comm.rank == 2:
            comm.barrier()  # (it dies there)
        while not comm.failed_ids():
            time.sleep(0.001)
        comm.lost_peers()
        arrived.wait()  # (both acknowledged before either goes on)
        if comm.rank == 0:
            comm.revoke()
            lost = comm.shrink()
        else:
            try:
                comm.agree()
                comm.barrier()  # went on: fails on the revoked communicator
            except PeerLost:
                comm.revoke()
                lost = comm.shrink()
        return lost, comm.size, comm.allreduce(torch.ones(1)).item()

    arrived = threading.Barrier(2)
    out = LossyWorld(3, deaths={2: 1}).run(main, timeout=10)
    assert out[:2] == [([2], 2, 2.0)] * 2


def test_a_rank_that_never_meets_the_others_is_a_deadlock_named_with_where_each_stands():
    def main(comm):
        if comm.rank == 0:
            comm.barrier()

    with pytest.raises(TimeoutError, match="rank 0: barrier"):
        LossyWorld(2, timeout=0.5).run(main, timeout=2)
