"""A counter across nodes serves the other ranks while its host computes (``python counter_across.py S``).

Rank 0 hosts the counter and then stays out of MPI for S seconds (a step's compute); every other rank
meanwhile makes 30 calls on it and reports how long they took. Exits 1 if any rank's calls waited for the
host (took more than half of S): the job's counter across nodes is served by a thread of its host
(runner/comm/counter.py); MPI's window over TCP served a call only when its host entered MPI.

``python counter_across.py S --rate``: the other ranks call it as fast as they can for S seconds instead;
rank 0 prints the calls per second its host served (the dealer's and the board's capacity).

``python counter_across.py S --latency``: every rank computes, as a job's ranks do, for S seconds; between
chunks of compute each rank but the host times one call, and every rank times a 1 ms sleep. Rank 0 prints
the medians: how long a call takes, and how late a process that waited 1 ms gets its core back (the
machine's share of a call: with many ranks a core, a waiting process waits for its turn).
"""

from __future__ import annotations

import sys
import time

from runner.comm.mpi import init

CALLS = 30


def rate(comm, seconds: float) -> int:
    """Every rank but the host calls the counter for ``seconds``; the calls per second served, on rank 0."""
    counter = comm.counter(1)
    comm.barrier()
    calls, end = 0, time.perf_counter() + seconds
    if comm.rank == 0:
        time.sleep(seconds)
    while comm.rank != 0 and time.perf_counter() < end:
        counter.fetch_add()
        calls += 1
    comm.barrier()
    total, counts = counter.read(0)[0], comm.allgather_object(calls)
    comm.barrier()  # (every rank read it: the host stops serving when it closes)
    counter.close()
    if comm.rank == 0:
        kind = type(counter).__name__
        print(f"{comm.size - 1} ranks: {total / seconds:.0f} calls/s served by the {kind}'s host")
    return 0 if total == sum(counts) else 1


def compute(seconds: float) -> None:
    """A chunk of a step's compute: small matrix products on one thread for about ``seconds``."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(64, 64)
    end = time.thread_time() + seconds  # (CPU time: the chunk is the same work whoever shares the core)
    while time.thread_time() < end:
        a = torch.tanh(a @ a)


def latency(comm, seconds: float, chunk: float = 0.005) -> int:
    """Each rank computes for ``seconds`` (wall), timing a call (not the host) and a 1 ms sleep between
    chunks; rank 0 prints the medians (ms)."""
    import statistics

    counter = comm.counter(1)
    comm.barrier()
    calls, sleeps, end = [], [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        compute(chunk)
        start = time.perf_counter()
        time.sleep(0.001)
        sleeps.append(time.perf_counter() - start - 0.001)
        if comm.rank != 0:
            start = time.perf_counter()
            counter.fetch_add()
            calls.append(time.perf_counter() - start)
    comm.barrier()
    every_call = [c for row in comm.allgather_object(calls) for c in row]
    every_sleep = [c for row in comm.allgather_object(sleeps) for c in row]
    total = counter.read(0)[0]
    comm.barrier()  # (every rank read it: the host stops serving when it closes)
    counter.close()
    if comm.rank == 0:
        call, late = 1000 * statistics.median(every_call), 1000 * statistics.median(every_sleep)
        kind = type(counter).__name__
        print(f"{comm.size} ranks computing: a {kind} call {call:.2f} ms, ", end="")
        print(f"a 1 ms sleep {late:.2f} ms late (medians)")
    return 0 if total == len(every_call) else 1


def main() -> int:
    busy = float(sys.argv[1])
    comm = init()
    if "--rate" in sys.argv:
        return rate(comm, busy)
    if "--latency" in sys.argv:
        return latency(comm, busy)
    counter = comm.counter(1)
    comm.barrier()
    took = 0.0
    if comm.rank == 0:
        time.sleep(busy)  # computing: no MPI call on the main thread
    else:
        start = time.perf_counter()
        for _ in range(CALLS):
            counter.fetch_add()
        took = time.perf_counter() - start
    comm.barrier()
    took_all = comm.allgather_object(took)
    total = counter.read(0)[0]
    comm.barrier()  # (every rank read it: the host stops serving when it closes)
    counter.close()
    if comm.rank == 0:
        print(
            f"calls of ranks 1..{comm.size - 1} took {[round(t, 3) for t in took_all[1:]]} s; total {total}"
        )
        if total != CALLS * (comm.size - 1) or max(took_all) > busy / 2:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
