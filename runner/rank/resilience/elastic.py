"""Growing a running job (``hardware.fault_tolerance=heal``, ``RUN_DIR/JOIN``): new workers spawned into it.

After the survivors of a lost worker have recovered (:mod:`runner.rank.resilience.recovery`), or when
``RUN_DIR/JOIN`` asks for more workers, the workers decide at an agreement point to grow, and at the start
of their next step (or epoch) every living rank, servers included, grows the job collectively
(:meth:`Elastic.grow`):

1. the workers meet (each is done with its calls on the world), every worker tells each server (a message
   after all of its others; the first starts the server's part), and the world is shrunk to the living;
2. ``MPI_Comm_spawn`` starts the new workers (``python -m runner.rank.worker RUN_DIR --joined ID``: ids
   are never reused, so a replacement has its own log and heartbeat) on the slots mpirun was given, and
   ``MPI_Intercomm_merge`` brings them in; the world is reordered workers first (survivors, then the new
   ones), servers last, as a fresh launch would be, and the workers' communicator split anew;
3. the workers then welcome the new ones (:meth:`runner.rank.resilience.growth.Growth.welcome`): worker 0
   gives them its model, optimizer, rule and position, the dealing of the data starts over among all of
   them, and each rule grows by its own math (:meth:`runner.rules.base.Rule.grow`).

A spawn that fails (no free slot, a command that does not start) is named on the console and the job goes
on with the workers it has.

``RUN_DIR/JOIN`` is read by worker 0 at the agreement (:mod:`runner.rank.join_request`).
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runner.comm import spares
from runner.comm.mpi import SERVER_KEY, PeerLost
from runner.comm.tags import GROW
from runner.rank.records.output import end_job
from runner.rules.base import split_roles
from runner.run_folder import CONFIG_SHA_ENV, EXIT, OVERSUBSCRIBED_ENV, TTY_ENV

if TYPE_CHECKING:
    from runner.comm import Comm

#: Environment variables a spawned worker gets from the rank that spawns it (mpirun's ``-x`` reach only
#: the ranks it started).
PASSED_ENV = (
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    TTY_ENV,
    OVERSUBSCRIBED_ENV,
    "CUDA_DEVICE_ORDER",
    "PYTHONPATH",
    CONFIG_SHA_ENV,
)


def spawn_argv(run_dir: Path, first_id: int, env: dict[str, str]) -> list[str]:
    """The command of the workers spawned into the job.

    The worker module with ``--joined`` and the id of the first of them (the others count up), through
    ``env`` so they get this rank's environment."""
    passed = [f"{k}={os.environ[k]}" for k in (*PASSED_ENV, *env) if k in os.environ]
    return [
        "env",
        *passed,
        sys.executable,
        "-m",
        "runner.rank.worker",
        str(run_dir),
        "--joined",
        str(first_id),
    ]


class Elastic:
    """One rank's side of growing the job: workers and servers alike take part in :meth:`grow`.

    ``workers``: this rank's communicator with the other workers (None on a server); ``servers``: the
    rule's server ranks (the last of ``world``); ``hosts``: every rank's host, by id (ids ``0 ..
    launched-1`` were launched; spawned ones count on from there); ``max_workers``: the most workers the
    job may have; ``env``: ``hardware.env``, passed on to spawned workers."""

    def __init__(
        self,
        world: Comm,
        workers: Comm | None,
        servers: int,
        run_dir: Path,
        hosts: list[str],
        max_workers: int,
        env: dict[str, str],
    ):
        self.world, self.workers, self.servers = world, workers, servers
        self.run_dir, self.hosts, self.max_workers, self.env = run_dir, hosts, max_workers, env
        self.joins: list[dict[str, Any]] = []  # every worker that joined: {rank, host, step, time}
        self.refusal: str | None = None  # why the last grow started fewer workers than asked for
        #: Within MPI_Comm_spawn and the new workers' settling in: a rank lost then may leave another rank
        #: waiting in the spawn for good (ULFM does not interrupt it), and the survivors' shrink with it.
        self.spawning = False
        #: Every worker agreed to grow and is in the growth (a loss from here on is recovered from within it,
        #: and the growth done again); until :class:`~runner.rank.resilience.growth.Growth` has welcomed
        #: the new workers.
        self.under_way = False
        #: Workers promoted or spawned into the job and not yet welcomed (:meth:`record`): one lost then is a
        #: replacement that never trained, whose loss leaves the one it replaced still to replace.
        self.arriving: list[int] = []

    @property
    def room(self) -> int:
        """Workers that may still join (``hardware.max_workers`` less the workers there are)."""
        return self.max_workers - (self.world.size - self.servers)

    def grow(self, want: int, near: list[str] | tuple[str, ...] = ()) -> list[int]:
        """Collective over the living ranks of the world: add ``want`` workers, at most :attr:`room`.

        Worker 0's count counts; servers pass 0. ``near``: the hosts of the lost workers they replace
        (heal), where an oversubscribed job starts them (Open MPI then sees every node as free, and chose
        the first). Returns the new workers' ids (:attr:`refusal` says why fewer than wanted)."""
        world = self.world
        if self.workers is not None:
            self._enter()
        world.shrink()
        first = len(self.hosts)
        room, asked_for = self.room, want
        want = int(world.broadcast_object(min(want, room) if world.rank == 0 else None))
        self.refusal = None
        if asked_for > max(room, 0):
            self.refusal = (
                f"{asked_for} worker(s) asked for, {max(room, 0)} may join: hardware.max_workers="
                f"{self.max_workers} workers at most"
            )
        if want <= 0:
            self.settle(world.rank)
            return []
        key = world.rank if world.rank < world.size - self.servers else SERVER_KEY + world.rank
        pool = world.spares
        if pool is not None and not pool.retired:
            if want <= len(pool.spare_ids):
                return self.promote(want, near, key)
            if world.rank == 0:
                spares.release(pool)  # (spawned workers are outside the pool: it serves no growth after)
            pool.retired = True
        self.spawning = True  # until the new workers are settled in (a loss meanwhile: Recovery.shrink)
        with SpawnWatch(world, self.hosts, self.run_dir):
            argv = spawn_argv(self.run_dir, first, self.env)
            known = os.environ.get(OVERSUBSCRIBED_ENV, "")  # the job's hosts when it is oversubscribed
            shared, names = bool(known), set(known.split(","))
            where = [h for h in near if h in names]  # (a name mpirun knows, never a "?")
            why = world.grow(argv, want, key, os.getcwd(), oversubscribe=shared, hosts=where)
            if why is not None:
                self.refusal = (
                    f"could not start {want} worker(s) (MPI_Comm_spawn: {why}); give mpirun free slots "
                    "(hardware.oversubscribe=true, or hosts with spare slots); the job goes on with "
                    f"{world.size - self.servers} workers"
                )
                self.settle(world.rank)
            else:
                # the new ids are named before they say where they run (a loss in the settling: recovery
                # names and fences them as "?", not an IndexError)
                self.hosts.extend("?" * (first + want - len(self.hosts)))
                self.arriving = list(range(first, first + want))
                self.settle(key)
        self.spawning = False
        return [] if why is not None else list(range(first, first + want))

    def _enter(self) -> None:
        """Workers: agree that every one is in the growth, then tell each server."""
        world = self.world
        # every worker is done with its calls on the world (a checkpoint's); ULFM's agreement, not a
        # barrier: one a worker lost in it had entered could let some go on to the spawn, the others
        # to recover, each waiting for the other
        self.workers.agree()
        self.under_way = True
        # every worker tells each server (after its other messages), not worker 0 alone: one lost after
        # the agreement would leave the servers serving while the others wait for them in the shrink
        # (the server grows at the first; the others' stay on the world it replaces)
        for server in range(world.size - self.servers, world.size):
            world.send(torch.zeros(1, dtype=torch.float64), server, GROW)

    def promote(self, want: int, near: list[str] | tuple[str, ...], key: int) -> list[int]:
        """Collective over the world's living ranks and the spares: promote ``want`` spares into the job.

        Those on the ``near`` hosts first, then the lowest ids. Returns their ids (fewer where spares were
        lost: :attr:`refusal` says so)."""
        world, pool = self.world, self.world.spares
        near = world.broadcast_object(list(near) if world.rank == 0 else None)
        if world.rank == 0:
            spares.call(pool)

        def choose(living: list[int]) -> list[int]:  # (on the lowest member, from what every member knows)
            return sorted(living, key=lambda i: (self.hosts[i] not in near, i))[:want]

        new, chosen, ids = spares.reform(pool, key, choose)
        world.adopt(new, ids)
        self.arriving = list(chosen)
        if len(chosen) < want:
            self.refusal = (
                f"{want} spare(s) wanted, {len(chosen)} alive (hardware.spares): the job goes on with "
                f"{world.size - self.servers} workers"
            )
        self.settle(key)
        return chosen

    def settle(self, key: int) -> None:
        """Collective over the world: learn every rank's host and split the workers' communicator anew.

        The world as it now is: a spawned worker calls it too, from :func:`arrive`."""
        world = self.world
        pairs = world.allgather_object((world.launch_rank(), platform.node()))
        for rank, host in sorted(pairs):
            while len(self.hosts) <= rank:
                self.hosts.append("?")
            self.hosts[rank] = host
        self.hosts[:] = world.broadcast_object(self.hosts)  # the lost ranks' hosts, which worker 0 knows
        if self.servers and self.workers is not None:
            self.workers.resplit(world, 0)
        elif self.servers:
            world.split_away(1, key)  # a server takes part in the workers' split and keeps nothing

    def record(self, ids: list[int], step: int) -> str:
        """Note that workers ``ids`` joined at ``step``; the console's line."""
        now, self.arriving = time.time(), []
        self.joins += [{"rank": r, "host": self.hosts[r], "step": step, "time": now} for r in ids]
        who = ", ".join(f"rank {r} ({self.hosts[r]})" for r in ids)
        workers = self.world.size - self.servers
        return f"{who} joined at step {step}; {workers} workers"


#: How long a rank waits in the job's growth after it learnt of a loss before it ends the job: ULFM does not
#: interrupt MPI_Comm_spawn, which a rank lost in it can leave waiting for good (a spawn that fails on every
#: rank returns within about a second; a shrink takes milliseconds).
SPAWN_GRACE_S = 3.0


class SpawnWatch:
    """Ends the job, naming the cause, when a loss stalls this rank's growth of the job.

    While this rank grows the job (``with``): a loss it learns of, still in the growth
    :data:`SPAWN_GRACE_S` later, ends the job with that cause named (:func:`stuck_in_spawn`), instead of
    a stall the watchdog ends a minute later naming a rank that waits."""

    def __init__(self, world: Comm, hosts: list[str], run_dir: Path):
        self.world, self.hosts, self.run_dir = world, hosts, run_dir
        self.done = threading.Event()

    def __enter__(self) -> SpawnWatch:
        threading.Thread(target=self._watch, name="spawn-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()

    def _watch(self) -> None:
        seen: float | None = None
        while not self.done.wait(0.25):
            try:
                lost = self.world.failed_ids()
            except Exception:  # (the communicator replaced meanwhile: its growth ends now)
                continue
            if lost and seen is None:
                seen = time.monotonic()
            elif lost and time.monotonic() - seen >= SPAWN_GRACE_S and not self.done.is_set():
                names = ", ".join(f"rank {i} ({self.hosts[i] if i < len(self.hosts) else '?'})" for i in lost)
                stuck_in_spawn(self.run_dir, self.world.launch_rank(), names)


def stuck_in_spawn(run_dir: Path, me: int, lost: str) -> None:
    """End the job, naming a loss during its growth (from a thread: the main one waits in MPI)."""
    cause = (
        f"{lost} was lost while the job grew (spawning a replacement), and {SPAWN_GRACE_S:g} s later this "
        "rank still waited in MPI_Comm_spawn or with the ranks in it, which ULFM cannot interrupt: the "
        "job ends; resume=RUN_DIR continues it from its last checkpoint"
    )
    end_job(run_dir, me, cause, EXIT["failed"])


class NotJoined(RuntimeError):
    """A spawned worker whose growth failed before it was one of the job's workers: it leaves quietly."""


def arrive(world: Comm, servers: int, run_dir: Path, max_workers: int, env: dict[str, str]) -> Elastic:
    """A spawned worker, right after it merged into the job: take part in :meth:`Elastic.settle`.

    It merged through :func:`runner.comm.mpi.join`, and settles with the ranks that spawned it (its workers:
    ``elastic.workers``).

    A loss in this first meeting (a rank lost while it was spawned) raises :class:`NotJoined`: the ranks that
    spawned it count it lost with the other and spawn anew (an error here would end the job they go on
    with)."""
    elastic = Elastic(world, None, servers, run_dir, [], max_workers, env)
    try:
        world.allgather_object((world.launch_rank(), platform.node()))  # worker 0 sends them whole below
        elastic.hosts = world.broadcast_object(None)
        elastic.workers = split_roles(world, servers)
    except PeerLost as err:
        why = f"a rank was lost while this replacement was spawned ({err}); the job goes on"
        raise NotJoined(why) from None
    return elastic
