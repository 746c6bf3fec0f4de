"""An mpirun job whose ranks all draw from the job's counter in a tight loop while ranks 1 to N-2 are killed
(SIGKILL, by a thread, rank k ``k * sys.argv[1]`` seconds in): the survivors, rank 0 (the counter's host) and
the last rank, must notice nothing and go on drawing until a second after the last kill; rank 0 prints
``survivors drew`` (``sys.argv[2]``: ``window`` uses MPI's window counter, which a rank killed inside an
update can leave locked for ever, ``served`` the counter a thread of its host serves, ``auto`` what the job's
communicator picks)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from runner.comm.counter import Counter, ServedCounter
from runner.comm.mpi import init

comm = init()
comm.return_errors()
counter = {"window": Counter, "served": ServedCounter}.get(sys.argv[2], type(comm).counter)(comm, 1)
every = float(sys.argv[1])
if 0 < comm.rank < comm.size - 1:
    if len(sys.argv) > 3:  # killed from outside (the pid in this file), at any instruction
        with open(sys.argv[3], "w") as f:
            f.write(str(os.getpid()))
    else:
        threading.Timer(every * comm.rank, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    while True:
        counter.fetch_add()
end, drawn = time.monotonic() + every * max(1, comm.size - 2) + 1, []
while time.monotonic() < end:
    drawn.append(counter.fetch_add())
assert len(set(drawn)) == len(drawn) and drawn == sorted(drawn)
if comm.rank == 0:
    print(f"survivors drew {len(drawn)} (rank 0), {type(counter).__name__}", flush=True)
time.sleep(0.5)  # (the last rank's draws end too before rank 0's process does)
os._exit(0)
