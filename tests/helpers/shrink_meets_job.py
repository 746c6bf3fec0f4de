"""An mpirun job of 3 ranks under ULFM: rank 2 dies and both survivors acknowledge it; then rank 0 goes to
recovery (revoke, shrink) while rank 1 is in an agreement (the loop's ``settle``). ULFM's shrink is itself
agreements, which match rank 1's: both must still end in one communicator of 2, and each prints
``rank R: N ranks, lost L, ids I`` on it. ``sys.argv[1]``: a folder for the survivors' signs."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from runner.comm import PeerLost
from runner.comm.mpi import init

comm, folder = init(), Path(sys.argv[1])
comm.return_errors()
comm.barrier()
if comm.rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
while not comm.failed_ids():  # (ULFM tells each survivor in its own time, as MPI makes progress)
    try:
        comm.check_peers()
    except PeerLost:
        pass
    time.sleep(0.01)
comm.saw_loss = False  # (this rank learnt of the loss before any call of its own failed)
comm.lost_peers()  # acknowledged on every survivor: an agreement then completes without an error
(folder / f"acked.{comm.rank}").touch()
lost: list[int] | None = None
if comm.rank == 0:
    while not (folder / "acked.1").exists():  # (a revoke before rank 1 knew of the loss would hide it)
        time.sleep(0.01)
    comm.revoke()
    lost = comm.shrink()
else:
    time.sleep(0.2)  # (rank 0 is in its shrink first)
    try:
        comm.agree()
        comm.allgather_object(comm.rank)  # went on: the next collective fails on the revoked communicator
    except PeerLost:
        comm.revoke()
        lost = comm.shrink()
ids = comm.allgather_object(comm.launch_rank())
print(f"rank {comm.rank}: {comm.size} ranks, lost {lost}, ids {ids}", flush=True)
time.sleep(0.3)  # (the others print before rank 0's process ends)
os._exit(0)
