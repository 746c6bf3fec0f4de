"""Every collective of the ``torch.distributed`` transport against MPI's, inside an mpirun job; exits
non-zero on a difference.

``python -m mpi4py tests/helpers/transport_job.py [gloo|nccl]``: two communicators over the same ranks, one
plain (MPI) and one carrying its tensors on the backend (gloo on CPU tensors, NCCL on each rank's GPU).
Each operation a rule uses (all-reduce sum/max/min, blocking, non-blocking and queued; the 16-bit exchange
in bf16 and fp16; broadcast from every root; all-to-all; all-gather) runs on both with the same inputs,
and the results must agree to 1e-6 (relative to values above 1: float32 sums in another order
differ in the last bits; the 16-bit exchange bit for bit: it moves the same bytes and sums in
the same order). Also: the bytes each counts, and a transport rebuilt over a split of the ranks.
"""

from __future__ import annotations

import sys

import torch

from runner.comm.mpi import init

ATOL = 1e-6


def inputs(rank: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * (rank + 1)).to(dtype).to(device)


def agree(name: str, ours: torch.Tensor, theirs: torch.Tensor, exact: bool = False) -> None:
    ours, theirs = ours.cpu().double(), theirs.cpu().double()
    diff = ((ours - theirs).abs() / theirs.abs().clamp(min=1)).max().item() if ours.numel() else 0.0
    if (exact and not torch.equal(ours, theirs)) or diff > ATOL:
        raise AssertionError(f"{name}: the transport differs from MPI by {diff:.3g} (relative)")


def check_allreduces(mpi, dist, device: torch.device) -> None:
    """Sum, max and min in float32 and float64; blocking, non-blocking and queued; 16-bit exchanges."""
    for dtype in (torch.float32, torch.float64):
        for op in ("sum", "max", "min"):
            a, b = inputs(mpi.rank, 1001, dtype, device), inputs(mpi.rank, 1001, dtype, device)
            mpi.allreduce(a, op)
            dist.allreduce(b, op)
            agree(f"allreduce {op} {dtype}", a, b)
        a, b = inputs(mpi.rank, 4097, dtype, device), inputs(mpi.rank, 4097, dtype, device)
        mpi.iallreduce(a).wait()
        request = dist.iallreduce(b)
        request.wait()
        agree(f"iallreduce {dtype}", a, b)
        c = inputs(mpi.rank, 333, dtype, device)
        dist.allreduce_background(c).wait()
        agree(f"allreduce_background {dtype}", c, mpi.allreduce(inputs(mpi.rank, 333, dtype, device)))
    for wire in (torch.bfloat16, torch.float16):
        a, b = inputs(mpi.rank, 1001, torch.float32, device), inputs(mpi.rank, 1001, torch.float32, device)
        before = (mpi.stats.bytes_sent, dist.stats.bytes_sent)
        mpi.allreduce(a, wire=wire)
        dist.allreduce(b, wire=wire)
        agree(f"16-bit exchange in {wire}", a, b, exact=True)
        sent = (mpi.stats.bytes_sent - before[0], dist.stats.bytes_sent - before[1])
        assert sent[0] == sent[1], f"bytes of the 16-bit exchange: MPI {sent[0]}, transport {sent[1]}"
        queued = inputs(mpi.rank, 1001, torch.float32, device)
        dist.allreduce_background(queued, wire=wire).wait()
        agree(f"queued 16-bit exchange in {wire}", a, queued, exact=True)


def check_data_movement(mpi, dist, device: torch.device) -> None:
    """Broadcast from every root, all-to-all and all-gather (float32 and bf16)."""
    n = mpi.size
    for root in range(n):
        a, b = inputs(mpi.rank, 257, torch.float32, device), inputs(mpi.rank, 257, torch.float32, device)
        mpi.broadcast(a, root)
        dist.broadcast(b, root)
        agree(f"broadcast from {root}", a, b, exact=True)
        agree(f"broadcast from {root} (the root's values)", b, inputs(root, 257, torch.float32, device), True)
    for dtype in (torch.float32, torch.bfloat16):
        send = inputs(mpi.rank, 7 * n, dtype, device)  # 7 or more: allgather sends the first 7
        a, b = torch.empty_like(send), torch.empty_like(send)
        mpi.alltoall(send, a)
        dist.alltoall(send, b)
        agree(f"alltoall {dtype}", a, b, exact=True)
        a, b = torch.empty(7 * n, dtype=dtype, device=device), torch.empty(7 * n, dtype=dtype, device=device)
        mpi.allgather(send[:7], a)
        dist.allgather(send[:7], b)
        agree(f"allgather {dtype}", a, b, exact=True)


def check_rebuilt(dist, device: torch.device) -> None:
    """After the communicator changes (here: the transport is rebuilt over the same ranks, as after a
    shrink), the new group reduces and the store lives on (new) rank 0."""
    generation = dist.dist.generation
    dist.dist.rebuild(dist)
    assert dist.dist.generation == generation + 1 and len(dist.dist.retired) == 1
    t = torch.ones(3, device=device)
    dist.allreduce(t)
    agree("allreduce after a rebuild", t, torch.full((3,), float(dist.size)), exact=True)


def main(backend: str) -> None:
    device = torch.device("cpu")
    mpi = init()
    if backend == "nccl":
        device = torch.device("cuda", mpi.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist = mpi.split(0)  # the same ranks, in the same order
    dist.use_transport(backend)
    assert dist.routes(torch.empty(1, device=device)) and not mpi.routes(torch.empty(1, device=device))
    check_allreduces(mpi, dist, device)
    check_data_movement(mpi, dist, device)
    check_rebuilt(dist, device)
    mpi.barrier()
    print(f"transport checks passed on {mpi.size} ranks ({backend})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gloo")
