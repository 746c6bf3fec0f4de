"""An in-process world whose ranks can die at any call: :class:`tests.helpers.fakecomm.FakeWorld` with ULFM.

``LossyWorld(n, deaths={rank: k})`` runs ``n`` ranks as threads (:meth:`FakeWorld.run`); launch rank
``rank`` dies as it enters its ``k``-th communication call (any method, on any of its communicators): the
call raises :class:`Killed`, and every later call of that rank too, so its thread ends as a killed process
would, having sent nothing more. The survivors see ULFM's semantics, which runner/comm/membership.py
relies on:

* a collective a dead member never entered fails with :class:`~runner.comm.errors.PeerLost` on every rank
  waiting in it (or entering it later); one it entered before dying completes;
* a send to, or a receive or probe from, a dead rank fails; a receive or probe from any source fails while
  a dead member is not acknowledged (:meth:`LossyComm.lost_peers` acknowledges);
* :meth:`LossyComm.revoke` makes every pending and later call on the communicator (and those split from it)
  fail; ULFM's agreements complete among the living, revoked or not, and fail on all of them alike when a
  member died that one had not acknowledged. They are one sequence per communicator, which the shrink's own
  agreements are part of, as in Open MPI: an ``MPI_Comm_agree`` of one member meets whatever agreement
  another makes next, a shrink's too. :meth:`~LossyComm.meet`, :meth:`~LossyComm.agree` and
  :meth:`~LossyComm.fault_barrier` are :class:`~runner.comm.membership.Membership`'s own, over
  ``Agree``; :meth:`~LossyComm.shrink` meets, then gives the living a new communicator in place (ranks in
  order);
* the shared counter (a window hosted by one rank) fails once its host died.

Launch ranks are ids as in a real job (``launch_rank``); the job never grows here (``grow`` refuses).
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from runner.comm import ANY_SOURCE, CommStats
from runner.comm.binding import MPI
from runner.comm.errors import PeerLost
from runner.comm.membership import Membership
from tests.helpers.fakecomm import FakeComm, FakeCounter, FakeRequest, FakeWorld, _Group


def stacks() -> str:
    """Where each rank's thread stands (its innermost frames of the runner's code)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if not names.get(ident, "").startswith("rank"):
            continue
        lines = [ln for ln in traceback.format_stack(frame) if "/runner/" in ln.splitlines()[0]]
        out.append(f"-- {names[ident]}:\n" + "".join(lines[-6:]))
    return "\n".join(out)


class Killed(BaseException):
    """This rank died (not an error of the test: its thread ends, as a killed process does)."""


class _LossyGroup(_Group):
    """A communicator's shared state, with its members' launch ranks and ULFM's state."""

    def __init__(self, world: LossyWorld, ids: list[int]):
        super().__init__(world, len(ids))
        self.ids, self.revoked = ids, False
        self.children: list[_LossyGroup] = []
        self.meetings: dict[Any, Any] = {}  # agreement number: its flags, acknowledgements and dead

    def dead(self) -> list[int]:
        """The members (ranks here) that died."""
        return [r for r, i in enumerate(self.ids) if i in self.world.dead]


class LossyWorld(FakeWorld):
    """``n`` ranks of which those in ``deaths`` (launch rank: call number) die at that call."""

    def __init__(self, n: int, deaths: dict[int, int] | None = None, timeout: float = 30.0):
        super().__init__(n, timeout)
        self.deaths = dict(deaths or {})
        self.dead: set[int] = set()
        self.calls = [0] * n  # communication calls per launch rank
        self.started: dict[int, int] = {}  # launch rank: its calls when start-up ended (a test sets it)
        group = _LossyGroup(self, list(range(n)))
        self.comms = [LossyComm(group, r, CommStats()) for r in range(n)]

    def run(self, fn: Callable[[FakeComm], Any], timeout: float | None = None) -> list[Any]:
        """As :meth:`FakeWorld.run`; a rank that died returns :class:`Killed` instead of a result."""

        def main(comm: FakeComm) -> Any:
            try:
                return fn(comm)
            except Killed as death:
                return death

        return super().run(main, timeout)

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """As :meth:`FakeWorld.wait_for`; a timeout names where every rank's thread stands."""
        try:
            super().wait_for(ready, what)
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n{stacks()}") from None

    def tick(self, launch: int) -> None:
        """Count a call of ``launch``; it dies at its drawn call (and stays dead)."""
        with self.cond:
            self.calls[launch] += 1
            if launch not in self.dead and self.calls[launch] == self.deaths.get(launch):
                self.dead.add(launch)
                self.cond.notify_all()
            if launch in self.dead:
                raise Killed(f"rank {launch} died at its call {self.deaths[launch]}")


class LossyComm(FakeComm):
    """One rank's communicator in a :class:`LossyWorld`: tolerant (calls raise ``PeerLost``)."""

    _g: _LossyGroup
    _w: LossyWorld

    def __init__(self, group: _LossyGroup, rank: int, stats: CommStats):
        super().__init__(group, rank, stats)
        self.tolerant, self.grown = True, False
        self._acked: set[int] = set()  # launch ranks whose death this rank acknowledged
        self._agreements = 0  # ULFM's agreements this rank entered on this communicator
        self.saw_loss, self._doomed = False, False  # (Membership.meet's)

    @property
    def ids(self) -> list[int]:
        return self._g.ids

    def launch_rank(self, rank: int | None = None) -> int:
        return self._g.ids[self.rank if rank is None else rank]

    # -- failure checks (``cond`` held) ------------------------------------------------------------------
    def _check(self) -> None:
        super()._check()
        if self._g.revoked:
            raise self._lost(f"rank {self.rank}: the communicator was revoked")

    def _broken(self, needed: Sequence[int]) -> bool:
        """Whether a wait on ``needed`` (ranks here) cannot complete: revoked, or one of them dead."""
        return self._g.revoked or any(self._g.ids[r] in self._w.dead for r in needed)

    def _lost(self, why: str) -> PeerLost:
        """The error a call raises on a lost peer; the rank's next agreement says it saw one."""
        self.saw_loss = True
        return PeerLost(why)

    def _unacked(self) -> bool:
        return any(self._g.ids[r] not in self._acked for r in self._g.dead())

    # -- collectives -------------------------------------------------------------------------------------
    def _collective(self, kind: tuple, data: Any, combine: Callable[[list], Any]) -> Callable[[bool], Any]:
        self._w.tick(self.launch_rank())
        poll = super()._collective(kind, data, combine)
        g, seq = self._g, self._seq - 1
        rnd = g.rounds[seq]

        def lossy(block: bool) -> tuple[bool, Any]:
            with self._w.cond:
                missing = lambda: [r for r in range(g.size) if r not in rnd.calls]  # noqa: E731
                if block:
                    what = f"rank {self.rank}: {kind[0]} #{seq}"
                    self._w.wait_for(lambda: rnd.done or self._broken(missing()), what)
                if not rnd.done and self._broken(missing()):
                    raise self._lost(f"rank {self.rank}: {kind[0]} #{seq}: a member died or it was revoked")
            return poll(block)

        return lossy

    def _agreement(self, flag: int, shrink: bool = False) -> tuple[int, list[int], bool]:
        """One of ULFM's agreements on this communicator (``MPI_Comm_agree``'s, or one of a shrink's: they
        are one sequence, numbered alike on every member, and the n-th of one member meets the n-th of
        another whatever call made it). It completes when every living member arrived; returns the AND of
        the flags given, the members dead then, and whether it failed: a dead member that some living one
        did not know of when it arrived (ULFM's rule, the same answer on every member): had not acknowledged,
        or (a ``shrink``'s, which agrees on the failed members) had not seen die."""
        g = self._g
        with self._w.cond:
            super()._check()
            number = self._agreements
            self._agreements += 1
            m = g.meetings.setdefault(number, SimpleNamespace(flags={}, acked={}, dead=None))
            known = {g.ids[r] for r in g.dead()} if shrink else set(self._acked)
            m.flags[self.rank], m.acked[self.rank] = flag, known
            self._w.cond.notify_all()

            def ready() -> bool:
                if m.dead is None and set(m.flags) >= set(range(g.size)) - set(g.dead()):
                    m.dead = g.dead()
                return m.dead is not None

            self._w.wait_for(ready, f"rank {self.rank}: agreement #{number}")
        value = int(all(m.flags.values()))
        failed = any(g.ids[d] not in acked for d in m.dead for acked in m.acked.values())
        return value, m.dead, failed

    @property
    def _c(self) -> SimpleNamespace:
        """What :meth:`Membership.meet` calls: ``Agree(flag)``, which raises ULFM's failure as MPI would."""

        def agree(flag: int) -> int:
            self._w.tick(self.launch_rank())
            value, _, failed = self._agreement(flag)
            if failed:
                raise MPI.Exception(MPI.ERR_PROC_FAILED)
            return value

        return SimpleNamespace(Agree=agree, Ack_failed=self.lost_peers)

    meet = Membership.meet
    agree = Membership.agree
    fault_barrier = Membership.fault_barrier

    def shrink(self) -> list[int]:
        """In place, over the living (every one must call it): returns the lost launch ranks.

        As :meth:`Membership.shrink`: a meeting first, then ULFM's shrink, agreements of the same sequence:
        on the failed members (again while one failed: comm_ft.c), then on the new communicator's id."""
        g, mine = self._g, self.launch_rank()
        self.meet(False)
        self._w.tick(mine)
        failed = True
        while failed:
            _, dead, failed = self._agreement(1, shrink=True)
        self._agreement(1)
        with self._w.cond:
            key = ("shrunk", self._agreements)
            if key not in g.meetings:  # the first one out makes the new group for all
                g.meetings[key] = _LossyGroup(self._w, [i for r, i in enumerate(g.ids) if r not in dead])
            new = g.meetings[key]
        self._g, self.rank, self.size = new, new.ids.index(mine), new.size
        self._seq, self._agreements, self.saw_loss, self._doomed = 0, 0, False, False
        return [g.ids[r] for r in dead]

    def revoke(self) -> None:
        with self._w.cond:
            for g in [self._g, *self._g.children]:
                g.revoked = True
            self._w.cond.notify_all()

    def check_peers(self) -> None:
        self._w.tick(self.launch_rank())
        with self._w.cond:
            self._check()
            if self._unacked():
                raise self._lost(f"rank {self.rank}: a peer died")

    def lost_peers(self) -> list[int]:
        with self._w.cond:
            dead = self._g.dead()
            self._acked |= {self._g.ids[r] for r in dead}
            return dead

    def lost_peers_ids(self) -> list[int]:
        return [self._g.ids[r] for r in self.lost_peers()]

    def failed_ids(self) -> list[int]:
        with self._w.cond:
            return [self._g.ids[r] for r in self._g.dead()]

    def return_errors(self) -> None:
        self.tolerant = True

    def grow(
        self,
        argv: list[str],
        count: int,
        key: int,
        wdir: str,
        oversubscribe: bool = False,
        hosts: Sequence[str] = (),
    ) -> str | None:
        return "no process is spawned in-process"

    def resplit(self, parent: Any, color: int) -> None:
        raise AssertionError("the job never grows in-process (grow refuses): nothing to split anew")

    def split_away(self, color: int, key: int) -> None:
        raise AssertionError("the job never grows in-process (grow refuses): nothing to split anew")

    def free(self) -> None:
        pass

    def split(self, color: int, key: int | None = None, keep: bool = True) -> LossyComm:
        def combine(members: list) -> dict[int, tuple[_LossyGroup, int]]:  # (color, key, old rank)
            placed = {}
            for c in {m[0] for m in members}:
                ranks = [old for _, _, old in sorted(m for m in members if m[0] == c)]
                group = _LossyGroup(self._w, [self._g.ids[r] for r in ranks])
                self._g.children.append(group)
                placed.update({old: (group, new) for new, old in enumerate(ranks)})
            return placed

        mine = (color, self.rank if key is None else key, self.rank)
        group, rank = self._collective(("split",), mine, combine)(True)[1][self.rank]
        return LossyComm(group, rank, self.stats)

    def counter(self, slots: int = 1, host: int = 0) -> FakeCounter:
        shared = self._collective(("counter", slots), None, lambda xs: [0] * slots)(True)[1]
        return LossyCounter(shared, self._w, self._g.ids[host])

    # -- point to point ----------------------------------------------------------------------------------
    def isend(self, t, dest: int, tag: int = 0, wire=None) -> FakeRequest:
        self._w.tick(self.launch_rank())
        with self._w.cond:
            self._check()
            if self._broken([dest]):
                raise self._lost(f"rank {self.rank}: send to rank {dest}, which died")
        return super().isend(t, dest, tag, wire)

    def _wait_match(self, source: int, tag: int) -> int:
        self._check()

        def ready() -> bool:
            if self._find(source, tag) is not None:
                return True
            lost = self._unacked() if source == ANY_SOURCE else self._broken([source])
            if lost or self._g.revoked:
                raise self._lost(f"rank {self.rank}: receive from {source}: a peer died or it was revoked")
            return False

        self._w.wait_for(ready, f"rank {self.rank}: recv {source} {tag}")
        return self._find(source, tag)

    def probe(self, source: int = ANY_SOURCE, tag: int = -1) -> tuple[int, int]:
        self._w.tick(self.launch_rank())
        return super().probe(source, tag)

    def recv(self, t, source: int = ANY_SOURCE, tag: int = -1, wire=None) -> tuple[int, int]:
        if wire is None:
            self._w.tick(self.launch_rank())
        return super().recv(t, source, tag, wire)

    def iprobe(self, source: int = ANY_SOURCE, tag: int = -1) -> tuple[int, int] | None:
        self._w.tick(self.launch_rank())
        with self._w.cond:
            self._check()
            if self._find(source, tag) is None:
                lost = self._unacked() if source == ANY_SOURCE else self._broken([source])
                if lost:
                    raise self._lost(f"rank {self.rank}: probe from {source}: a peer died")
        return super().iprobe(source, tag)


class LossyCounter(FakeCounter):
    """The shared counter, hosted by launch rank ``host``: every operation fails once the host died."""

    def __init__(self, values: list[int], world: LossyWorld, host: int):
        super().__init__(values, world.cond)
        self._world, self._host = world, host

    def _alive(self) -> None:
        if self._host in self._world.dead:
            raise PeerLost(f"the counter's host, rank {self._host}, died")

    def fetch_add(self, slot: int = 0, value: int = 1) -> int:
        self._alive()
        return super().fetch_add(slot, value)

    def fetch_max(self, slot: int, value: int) -> int:
        self._alive()
        return super().fetch_max(slot, value)

    def compare_and_swap(self, slot: int, compare: int, value: int) -> int:
        self._alive()
        return super().compare_and_swap(slot, compare, value)

    def put(self, slot: int, values: Sequence[int]) -> None:
        self._alive()
        super().put(slot, values)

    def read(self, slot: int = 0, count: int = 1) -> list[int]:
        self._alive()
        return super().read(slot, count)
