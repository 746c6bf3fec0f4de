"""An mpirun job of 3 ranks that all draw from the job's counter in a tight loop while rank 1 is killed
(SIGKILL, by a thread, ``sys.argv[1]`` seconds in): the survivors must notice nothing and go on drawing
until a second after it; rank 0 prints ``survivors drew`` (``sys.argv[2]``: ``window`` uses MPI's
window counter, which a rank killed inside an update can leave locked for ever, ``auto`` what the job's
communicator picks)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from runner.comm.counter import Counter
from runner.comm.mpi import init

comm = init()
comm.return_errors()
counter = Counter(comm, 1) if sys.argv[2] == "window" else comm.counter(1)
if comm.rank == 1:
    if len(sys.argv) > 3:  # killed from outside (the pid in this file), at any instruction
        with open(sys.argv[3], "w") as f:
            f.write(str(os.getpid()))
    else:
        threading.Timer(float(sys.argv[1]), lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    while True:
        counter.fetch_add()
end, drawn = time.monotonic() + float(sys.argv[1]) + 1, []
while time.monotonic() < end:
    drawn.append(counter.fetch_add())
assert len(set(drawn)) == len(drawn) and drawn == sorted(drawn)
if comm.rank == 0:
    print(f"survivors drew {len(drawn)} (rank 0), {type(counter).__name__}", flush=True)
time.sleep(0.5)  # (rank 2's draws end too before rank 0's process does)
os._exit(0)
