"""Warm spares (``hardware.spares``): ranks launched with the job that wait, idle, to replace a lost worker.

A spawned replacement starts a new process (Python and torch: about 3 s); a spare has started already, so
the job heals in the time of a shrink and a split. The launch's ranks are split into the job's members (its
world: workers, then servers) and the spares (the last ranks). All of them stay in one communicator, the
pool, which the job grows through (:func:`reform`):

1. the members' rank 0 tells every spare it knows of to come (:data:`~runner.comm.tags.SPARE`);
2. members and spares shrink the pool to the living, and its lowest member names the spares to promote;
3. the pool is split into the new world (members in their order, then the promoted) and the spares left;
4. all agree (ULFM) that the split succeeded everywhere: a loss in it leaves every rank where it was (the
   members recover and grow again; the spares wait again).

A job that spawns (no spare left) has members outside the pool, so the pool is retired then: its spares
leave, as they do when the job ends (:func:`release`).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runner.comm.binding import MPI
from runner.comm.errors import FAULTS, PeerLost, agreed, failed_ranks
from runner.comm.tags import SPARE

#: How often a waiting spare looks for its call (the promotion's delay at most; its CPU is negligible).
POLL_S = 0.02


@dataclass
class Pool:
    """The launch's living ranks, members and spares (``c``: their communicator, errors returned).

    ``ids``: each pool rank's id in the job (its launch rank); ``spare_ids``: the spares not yet promoted;
    ``hosts``: every launched rank's host, by id. The same on every rank of the pool."""

    c: Any
    ids: list[int]
    spare_ids: list[int]
    hosts: list[str]
    retired: bool = False
    mine: int = field(init=False)

    def __post_init__(self) -> None:
        self.mine = self.ids[self.c.Get_rank()]

    @property
    def is_spare(self) -> bool:
        return self.mine in self.spare_ids

    def send(self, message: tuple[Any, ...], ids: Sequence[int]) -> None:
        """``message`` to the spares ``ids``; one lost meanwhile is skipped (the shrink leaves it out)."""
        for i in ids:
            try:
                self.c.send(message, dest=self.ids.index(i), tag=SPARE)
            except MPI.Exception as err:
                if err.Get_error_class() not in FAULTS:
                    raise


def split_launch(launch: Any, spares: int) -> tuple[Any, Pool]:
    """Collective over the launch (``launch``: its MPI communicator): the members' communicator and the pool.

    The spares are the last ``spares`` ranks; a spare gets None. The members keep their launch ranks as
    ids."""
    c = launch.Dup()
    c.Set_errhandler(MPI.ERRORS_RETURN)
    size, rank = c.Get_size(), c.Get_rank()
    assert 0 < spares < size, f"{spares} spares leave no member among {size} ranks"
    pool = Pool(c, list(range(size)), list(range(size - spares, size)), c.allgather(platform.node()))
    members = c.Split(int(pool.is_spare), rank)
    if pool.is_spare:
        members.Free()
        return None, pool
    return members, pool


def call(pool: Pool) -> None:
    """A member (the world's rank 0): tell every spare to come to :func:`reform`."""
    pool.send(("come",), pool.spare_ids)


def release(pool: Pool) -> None:
    """A member (the world's rank 0), when the job ends or spawns: every spare leaves."""
    if not pool.retired:
        pool.send(("leave",), pool.spare_ids)
        pool.retired = True


def wait(pool: Pool, beat: Callable[[], None]) -> str:
    """A spare: wait for the members' call (``come`` or ``leave``); ``beat`` is called at every look.

    ``leave`` too when every member is gone (a job that ended without telling, or failed)."""
    while True:
        try:
            if pool.c.Iprobe(source=MPI.ANY_SOURCE, tag=SPARE):
                return str(pool.c.recv(source=MPI.ANY_SOURCE, tag=SPARE)[0])
        except MPI.Exception as err:
            if err.Get_error_class() not in FAULTS:
                raise
            pool.c.Ack_failed()  # (a wildcard probe goes on among the living once acknowledged)
            if set(pool.ids) - set(pool.spare_ids) <= set(failed_ids(pool)):
                return "leave"
        beat()
        time.sleep(POLL_S)


def failed_ids(pool: Pool) -> list[int]:
    """The ids of the pool's ranks this process knows died."""
    return [pool.ids[r] for r in failed_ranks(pool.c)]


def reform(
    pool: Pool, key: int, choose: Callable[[list[int]], list[int]] | None
) -> tuple[Any, list[int], list[int]]:
    """Collective over the pool's living ranks: shrink it, promote spares, split off the new world.

    ``key``: this rank's order in the new world (a spare's: the first promoted one's, the next ones count
    on from it; ``runner.comm.membership.GROWN_KEY``, after the workers and before the servers).
    ``choose`` (the lowest member's): the spares to promote, of the living ones. Returns the new world's MPI
    communicator (None on a spare left waiting), the promoted ids, and the new world's ids by rank, found
    without a call: a loss right after this surfaces in the job's next collective, which the members
    recover from.

    Raises :class:`PeerLost` on every rank alike if a rank was lost in it; nobody was promoted then."""
    shrunk = pool.c.Shrink()
    shrunk.Set_errhandler(MPI.ERRORS_RETURN)
    new, ok = None, 1
    try:
        ids = shrunk.allgather(pool.mine)
        living = [i for i in pool.spare_ids if i in ids]
        members = [r for r, i in enumerate(ids) if i not in pool.spare_ids]
        if not members:  # (every member was lost after its call: nobody to join; the spares leave)
            raise PeerLost("every member of the job was lost")
        chosen = shrunk.bcast(choose(living) if shrunk.Get_rank() == members[0] else None, members[0])
        promoted = pool.mine in chosen
        order = key + chosen.index(pool.mine) if promoted else key
        new = shrunk.Split(0 if promoted or not pool.is_spare else 1, order)
        group = new.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), shrunk.Get_group())
        world_ids = [ids[r] for r in ranks]
        group.Free()
    except PeerLost:
        ok = 0
    except MPI.Exception as err:
        if err.Get_error_class() not in FAULTS:
            raise
        ok = 0
    if not agreed(shrunk, ok):
        if new is not None:
            new.Free()
        raise PeerLost("a rank was lost while spares were promoted")
    pool.c, pool.ids = shrunk, ids
    pool.spare_ids = [i for i in living if i not in chosen]
    if pool.is_spare:
        new.Free()
        return None, chosen, []
    new.Set_errhandler(MPI.ERRORS_RETURN)
    return new, chosen, world_ids
