"""Checks of the hierarchical exchange (runner/comm/routes/hierarchical.py) inside an mpirun job on this
machine, its ranks on pretend hosts; exits non-zero on failure.

``python -m mpi4py tests/helpers/hierarchical_job.py 2,2``: ranks 0-1 on host 0, ranks 2-3 on host 1 (the
layout's sum must be the job's size)."""

from __future__ import annotations

import sys

import torch

from runner.comm.mpi import init
from runner.comm.routes.hierarchical import Hierarchical, library_does_it, settle

#: Tensor lengths: fewer values than ranks, odd, and over two segments between hosts.
SIZES = (1, 3, 7, 1001, 600_001)


def host_of(layout: list[int], rank: int) -> int:
    """The pretend host of ``rank`` in ``layout`` (ranks per host, in rank order)."""
    total = 0
    for host, count in enumerate(layout):
        total += count
        if rank < total:
            return host
    raise AssertionError(f"rank {rank} is past the layout {layout}")


def values(n: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A rank's contribution: distinct per rank and element, of mixed signs."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=g, dtype=torch.float64) * (rank + 1)).to(dtype)


def flat(c, t: torch.Tensor, op: str) -> torch.Tensor:
    """``t`` all-reduced by MPI itself (the flat exchange)."""
    from runner.comm.binding import MPI, OPS

    out = t.clone()
    c._c.Allreduce(MPI.IN_PLACE, out.numpy(), op=OPS[op])
    return out


def close(c, got: torch.Tensor, expected: torch.Tensor, n: int, dtype: torch.dtype) -> bool:
    """Whether ``got`` equals ``expected`` to 1e-6 of the sum of the contributions' magnitudes (summed in
    another order, float32 sums differ by rounding: at most (N-1) ulps of that sum)."""
    scale = flat(c, values(n, c.rank, dtype).abs(), "sum")
    return bool(((got - expected).abs() <= 1e-6 * scale).all())


def check_results(c) -> None:
    """Sums, means, max and min equal the flat exchange's to 1e-6, blocking and queued."""
    for dtype in (torch.float32, torch.float64):
        for n in SIZES:
            for op in ("sum", "max", "min"):
                t = values(n, c.rank, dtype)
                expected = flat(c, t, op)
                assert isinstance(c.route_for("allreduce", (t,)), Hierarchical)
                c.allreduce(t, op)
                assert close(c, t, expected, n, dtype), (dtype, n, op, (t - expected).abs().max())
            mean = values(n, c.rank, dtype)
            c.allreduce(mean).div_(c.size)
            assert close(c, mean, flat(c, values(n, c.rank, dtype), "sum") / c.size, n, dtype), (dtype, n)
            queued = values(n, c.rank, dtype)
            c.allreduce_background(queued).wait()
            assert close(c, queued, flat(c, values(n, c.rank, dtype), "sum"), n, dtype), (dtype, n)


def check_declines(c) -> None:
    """What the route leaves to the others: 16-bit exchanges, integers, non-blocking all-reduces; and the
    bytes counted are the flat exchange's."""
    t = values(64, c.rank, torch.float32)
    assert not isinstance(c.route_for("allreduce", (t,), torch.bfloat16), Hierarchical)
    assert not isinstance(c.route_for("allreduce", (torch.ones(4, dtype=torch.int64),)), Hierarchical)
    assert not isinstance(c.route_for("iallreduce", (t,)), Hierarchical)
    before = c.stats.bytes_sent
    c.allreduce(t)
    assert c.stats.bytes_sent - before == int(t.numel() * 4 * 2 * (c.size - 1) / c.size)
    c.iallreduce(t).wait()


def main() -> None:
    layout = [int(v) for v in sys.argv[1].split(",")]
    c = init()
    assert sum(layout) == c.size, (layout, c.size)
    host = host_of(layout, c.rank)
    applies = len(layout) > 1 and max(layout) > 1
    if applies:  # auto: this route, unless MPI's own all-reduce is hierarchical (Open MPI 5's coll/han)
        assert settle(c, "auto", host) == ("mpi" if library_does_it() else "on")
    try:
        mode = settle(c, "on", host)
    except ValueError as err:
        assert not applies and "hardware.hierarchical=on" in str(err), err
        assert settle(c, "auto", host) == "off" and c.route(Hierarchical).hosts is None
        if c.rank == 0:
            print(f"hierarchical: not taken on {layout}", flush=True)
        return
    assert applies and mode == "on"
    check_results(c)
    check_declines(c)
    c.barrier()
    if c.rank == 0:
        print(f"hierarchical checks passed on {layout}", flush=True)


if __name__ == "__main__":
    main()
