"""Checks of runner.comm run inside an mpirun job (any number of ranks); exits non-zero on failure."""

from __future__ import annotations

import torch

from runner.comm import Comm, wait_all


def main() -> None:
    c = Comm()
    r, n = c.rank, c.size
    expected_sum = n * (n + 1) / 2

    t = torch.full((1000,), float(r + 1))
    ptr = t.data_ptr()
    c.allreduce(t)
    assert t.data_ptr() == ptr and torch.all(t == expected_sum), t[:3]
    assert c.bytes_sent == (4000 * 2 * (n - 1) // n if n > 1 else 0), c.bytes_sent

    m = torch.full((3,), float(r))
    c.allreduce(m, op="max")
    assert torch.all(m == n - 1)

    reqs = [c.iallreduce(torch.full((10,), float(r + 1))) for _ in range(3)]
    bufs = [torch.full((257,), float(r + 1), dtype=torch.float64) for _ in range(2)]
    reqs += [c.iallreduce(b) for b in bufs]
    wait_all(reqs)
    assert all(torch.all(b == expected_sum) for b in bufs)

    nc = torch.arange(12.0).reshape(3, 4).t() * (r + 1)  # non-contiguous: staged through a copy
    c.allreduce(nc)
    assert torch.equal(nc, torch.arange(12.0).reshape(3, 4).t() * expected_sum)

    root = n - 1
    b = torch.full((5,), float(r))
    c.broadcast(b, root=root)
    assert torch.all(b == root)

    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        req = c.isend(torch.full((4,), float(r)), dest=right, tag=7)
        while c.iprobe(source=left, tag=7) is None:
            pass
        assert c.probe(source=left, tag=7) == (left, 7)
        got = torch.empty(4)
        assert c.recv(got, source=left, tag=7) == (left, 7)
        req.wait()
        assert torch.all(got == left)
    assert c.iprobe() is None, "a message was left in flight"

    assert c.allreduce_values([1.0, r]) == [n, n * (n - 1) / 2]
    assert c.allgather_object(r) == list(range(n))
    even = c.split(r % 2)
    assert even.size == len(range(r % 2, n, 2))
    assert c.local_size() == n
    c.barrier()
    if r == 0:
        print(f"comm checks passed on {n} ranks")


if __name__ == "__main__":
    main()
