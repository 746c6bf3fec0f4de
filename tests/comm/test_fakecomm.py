"""The in-process communicator the rules' math runs on (tests/helpers/fakecomm.py): its collectives,
point-to-point messages, splits and accounting, and that a deadlock or a crash fails fast."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fakecomm import FakeWorld


def test_fakecomm_combines_matches_splits_and_accounts():
    def main(comm):
        t = torch.tensor([1.0, -1.0]) * (comm.rank + 1)
        sums, maxs, mins = comm.allreduce(t.clone()), comm.allreduce(t.clone(), "max"), t.clone()
        request = comm.iallreduce(mins, "min")
        root = comm.broadcast(torch.tensor([float(comm.rank)]), root=2)
        sub = comm.split(comm.rank % 2, key=-comm.rank)  # colour 0: ranks 2, 0 in this order
        sub_sum = sub.allreduce(torch.tensor([float(comm.rank)]))
        for tag in (7, 8):
            comm.send(torch.tensor([float(tag)]), (comm.rank + 1) % 3, tag=tag)
        got8, got7 = torch.zeros(1), torch.zeros(1)
        source = comm.recv(got8, tag=8)  # passes over the earlier tag-7 message
        comm.recv(got7, source[0], 7)
        assert comm.iprobe() is None
        request.wait()
        values = comm.allreduce_values([1.0, comm.rank], "max")
        return [x.tolist() for x in (sums, maxs, mins, root, sub_sum, got8, got7)], source, sub.rank, values

    ranks = FakeWorld(3).run(main)
    for rank, (tensors, source, sub_rank, values) in enumerate(ranks):
        assert tensors[:4] == [[6.0, -6.0], [3.0, -1.0], [1.0, -3.0], [2.0]]
        assert tensors[4:] == [[2.0] if rank != 1 else [1.0], [8.0], [7.0]]
        assert source == ((rank - 1) % 3, 8) and sub_rank == {0: 1, 1: 0, 2: 0}[rank] and values == [1.0, 2.0]
    world = FakeWorld(3)
    world.run(main)
    # 3 all-reduces of 8 bytes: 3·int(8·4/3); broadcast at rank 2: 2·4; the colour-0 all-reduce: 4; sends: 8
    assert [c.stats.bytes_sent for c in world.comms] == [30 + 4 + 8, 30 + 8, 30 + 8 + 4 + 8]
    assert world.messages == 6


def test_fakecomm_fails_fast_on_deadlock_and_errors():
    def crossed_sends(comm):
        comm.send(torch.zeros(1), 1 - comm.rank)
        comm.recv(torch.zeros(1))

    FakeWorld(2).run(crossed_sends)  # buffered sends: fine
    with pytest.raises(TimeoutError, match="deadlock"):
        FakeWorld(2, timeout=0.2, sync_sends=True).run(crossed_sends)

    def crash(comm):
        if comm.rank == 0:
            raise KeyError("boom")
        comm.barrier()

    with pytest.raises(KeyError, match="boom"):
        FakeWorld(2, timeout=5).run(crash, timeout=1)
