"""A warm spare's life (``hardware.spares``): idle until promoted into the job, or released at its end.

The spare has imported torch and the runner and bound its threads before it waits, so a promotion costs the
job a shrink, a split and the new worker's build (:mod:`runner.comm.spares`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.comm import spares
from runner.comm.errors import PeerLost
from runner.comm.mpi import GROWN_KEY
from runner.hardware.topology import read_topology
from runner.rank.placement import bind_threads

if TYPE_CHECKING:
    from runner.comm.mpi import Comm
    from runner.hardware.base import HardwareConfig
    from runner.rank.records.heartbeat import Heartbeat


def stand_by(hw: HardwareConfig, launch: Comm, pool: spares.Pool, beat: Heartbeat) -> Comm | None:
    """Wait to be promoted; the job's world once this spare is one of its workers, None when released.

    ``launch``: the launch's world (whose settings the new one takes). A rank lost during a promotion that
    did not choose this spare, or failed, leaves it waiting as before."""
    from runner.comm.mpi import Comm

    beat.set_role("spare")  # (the launcher's watchdog does not wait for a spare)
    binding = bind_threads(hw, pool.mine, read_topology())
    where = f"{binding['host']}, cores {binding['cores']}"
    print(f"rank {pool.mine}: a spare on {where}, waiting to replace a worker")
    while True:
        if spares.wait(pool, beat.progress) == "leave":
            return None
        try:
            new, _, ids = spares.reform(pool, GROWN_KEY, None)
        except PeerLost:
            continue
        if new is not None:
            world = Comm(new, launch.cuda_aware, launch.stats)
            world.adopt(new, ids)
            world.spares = pool
            beat.set_role("worker")
            return world
