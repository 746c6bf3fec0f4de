"""Checks of runner.comm run inside an mpirun job (any number of ranks); exits non-zero on failure.

``python -m mpi4py tests/helpers/comm_job.py [cpu|cuda]``: the tensors live on that device. On the CPU,
non-contiguous tensors take the staging path (host copy in, MPI call, copy back) of every operation; on a GPU
every tensor does, unless the MPI library is CUDA-aware, when device memory goes to MPI directly.
"""

from __future__ import annotations

import sys

import torch

from runner.comm.mpi import init, wait_all


def odd(values: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor holding ``values`` (every other element of a buffer), so MPI cannot use it."""
    out = torch.zeros(2 * values.numel(), dtype=values.dtype, device=values.device)[::2]
    assert not out.is_contiguous()
    return out.copy_(values)


def check_wire(c, dev: torch.device, wire: torch.dtype) -> None:
    """16-bit exchange (runner/comm/wire.py) over real MPI: sums in float32 of 16-bit contributions, the same
    bits on every rank, half the bytes, and point-to-point messages widened on receipt; 1001 values, so
    the all-to-all's chunks are padded whenever 1001 is not a multiple of the ranks."""
    r, n = c.rank, c.size
    values = torch.linspace(-3, 3, 1001, device=dev) * (r + 1) + 1 / 3
    t = values.clone()
    before = c.stats.bytes_sent
    c.allreduce(t, wire=wire)
    sent = c.stats.bytes_sent - before
    parts = [(torch.linspace(-3, 3, 1001, device=dev) * (k + 1) + 1 / 3).to(wire).float() for k in range(n)]
    expected = sum(parts).to(wire).float() if n > 1 else values
    assert torch.equal(t, expected), (t - expected).abs().max()
    assert torch.equal(torch.tensor(c.allgather_object(t.sum().item())), torch.full((n,), t.sum().item()))
    chunk = -(-1001 // n)
    assert sent == (2 * (n - 1) * chunk * 2 if n > 1 else 0), sent
    background = values.clone()
    c.allreduce_background(background, wire=wire).wait()
    assert torch.equal(background, expected)
    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        req = c.isend(values, dest=right, tag=9, wire=wire)
        got = torch.empty(1001, device=dev)
        c.recv(got, source=left, tag=9, wire=wire)
        req.wait()
        assert torch.equal(
            got, (torch.linspace(-3, 3, 1001, device=dev) * (left + 1) + 1 / 3).to(wire).float()
        )


def main(device: str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    c = init()
    r, n = c.rank, c.size
    expected_sum = n * (n + 1) / 2

    def full(size: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((size,), float(value), dtype=dtype, device=dev)

    t = full(1000, r + 1)
    ptr = t.data_ptr()
    c.allreduce(t)
    assert t.data_ptr() == ptr and torch.all(t == expected_sum), t[:3]
    assert c.stats.bytes_sent == (4000 * 2 * (n - 1) // n if n > 1 else 0), c.stats.bytes_sent

    m = full(3, r)
    c.allreduce(m, op="max")
    assert torch.all(m == n - 1)

    reqs = [c.iallreduce(full(10, r + 1)) for _ in range(3)]
    bufs = [full(257, r + 1, torch.float64) for _ in range(2)]
    reqs += [c.iallreduce(b) for b in bufs]
    wait_all(reqs)
    assert all(torch.all(b == expected_sum) for b in bufs)

    nc = torch.arange(12.0, device=dev).reshape(3, 4).t() * (r + 1)
    c.allreduce(nc)
    assert torch.equal(nc, torch.arange(12.0, device=dev).reshape(3, 4).t() * expected_sum)

    nci = odd(torch.arange(6.0, device=dev) * (r + 1))
    req = c.iallreduce(nci)
    req.wait()
    assert torch.equal(nci, torch.arange(6.0, device=dev) * expected_sum), nci

    background = [full(33, r + 1), odd(full(5, r + 1))]
    for request in [c.allreduce_background(x) for x in background]:
        request.wait()
    assert all(torch.all(x == expected_sum) for x in background), background

    root = n - 1
    b = full(5, r)
    c.broadcast(b, root=root)
    assert torch.all(b == root)
    bo = odd(full(4, r))
    c.broadcast(bo, root=root)
    assert torch.all(bo == root), bo

    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        req = c.isend(full(4, r), dest=right, tag=7)
        while c.iprobe(source=left, tag=7) is None:
            pass
        assert c.probe(source=left, tag=7) == (left, 7)
        got = torch.empty(4, device=dev)
        assert c.recv(got, source=left, tag=7) == (left, 7)
        req.wait()
        assert torch.all(got == left)

        c.send(odd(full(3, r)), dest=right, tag=8)  # small: completes eagerly, so the ring cannot block
        got_odd = odd(torch.zeros(3, device=dev))
        c.recv(got_odd, source=left, tag=8)
        assert torch.all(got_odd == left), got_odd
    assert c.iprobe() is None, "a message was left in flight"

    for wire in (torch.bfloat16, torch.float16):
        check_wire(c, dev, wire)

    assert c.allreduce_values([1.0, r]) == [n, n * (n - 1) / 2]
    assert c.allgather_object(r) == list(range(n))
    even = c.split(r % 2)
    assert even.size == len(range(r % 2, n, 2))
    assert c.local_size() == n and c.local_rank() == r
    c.barrier()
    if r == 0:
        mode = "direct" if dev.type == "cuda" and c.cuda_aware else "staged"
        print(
            f"comm checks passed on {n} ranks ({dev.type}, {mode}, {c.host_buffers.allocated} pinned buffers)"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
