"""A counter across nodes serves the other ranks while its host computes (``python counter_across.py S``).

Rank 0 hosts the counter and then stays out of MPI for S seconds (a step's compute); every other rank
meanwhile makes 30 calls on it and reports how long they took. Exits 1 if any rank's calls waited for the
host (took more than half of S): Open MPI's TCP transport serves a one-sided call only when the host
enters MPI, which its counter's progress thread does (runner/comm/counter.py).
"""

from __future__ import annotations

import sys
import time

from runner.comm.mpi import init

CALLS = 30


def main() -> int:
    busy = float(sys.argv[1])
    comm = init()
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
