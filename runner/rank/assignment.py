"""Dynamic assignment (``data.assignment=dynamic``): the workers take an epoch's samples chunk by chunk.

They take them from one shared counter, so a fast worker trains on more of the epoch and a slow one on less.

Every epoch is one permutation of the training set, drawn from ``train.seed + epoch`` on every worker, cut
into ``per_epoch`` chunks of one step each (``batch_size × accumulate`` samples; the last chunk also takes
the remainder, so every sample is in exactly one chunk). Chunks are numbered over the whole run, ``ticket =
epoch × per_epoch + chunk``, and dealt in that order by a :class:`~runner.comm.Counter` (MPI one-sided
atomics held by worker 0): a worker draws its next ticket when it starts a step, and no worker waits for
another to get one. The run ends when the tickets do (``train.epochs``, or ``train.max_steps × devices``
chunks: as many samples as with static shards).

The workers meet at fixed ticket positions of each epoch (:class:`Meetings`): every ``interval`` chunks for
the stop/checkpoint agreement, at the validations of ``train.val_every`` below one epoch, and at the epoch's
end. A worker passes a position when it draws a ticket at or past it (or when its epoch ends), before it
trains that ticket. A checkpoint, taken at a meeting, records what is left to deal (:func:`dealing_state`:
the tickets the workers hold, those still pending, and the first never drawn), and a resumed run deals
them again, with no chunk lost or trained twice. Under fault tolerance every worker publishes the tickets
it holds in the counter's memory, and the survivors of its loss deal them again (:func:`redeal`).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runner.comm import Counter
    from runner.comm.face import CommLike

#: Meetings for the stop/checkpoint agreement are this many chunks per worker apart. A fast worker waits at
#: one for the agreement started at the one before, so it waits only for a worker more than an interval's
#: chunks behind it: 8 per worker lets one worker be about 8x slower than the rest before it holds them.
CHUNKS_PER_WORKER = 8
#: Tickets a worker may hold at once (the step's, its loader processes' one batch ahead each, the next
#: epoch's first, and what is left of its last block: up to 8 chunks a draw), published for the survivors
#: under fault tolerance.
HELD_SLOTS = 16


@dataclass
class Chunks:
    """An epoch's permutation of ``samples`` training samples cut into chunks of one step.

    A chunk is ``accumulate`` micro-batches of ``batch`` samples (the epoch's last chunk takes the remainder
    in its last one)."""

    samples: int
    batch: int
    accumulate: int
    seed: int
    _perm: tuple[int, list[int]] = field(default=(-1, []), repr=False)

    @property
    def size(self) -> int:
        return self.batch * self.accumulate

    @property
    def per_epoch(self) -> int:
        return max(1, self.samples // self.size)

    def epoch_of(self, ticket: int) -> int:
        return ticket // self.per_epoch

    def micro_batches(self, ticket: int) -> list[list[int]]:
        """The sample indices of chunk ``ticket``, as its micro-batches."""
        epoch, chunk = divmod(ticket, self.per_epoch)
        if self._perm[0] != epoch:
            order = torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            self._perm = (epoch, order.tolist())
        start = chunk * self.size
        end = self.samples if chunk == self.per_epoch - 1 else start + self.size
        cuts = [start + i * self.batch for i in range(self.accumulate)] + [end]
        return [self._perm[1][a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


class Dealer:
    """The batch sampler of a worker's loader under dynamic assignment.

    Each epoch it yields the micro-batches of the tickets it draws, until it draws one of a later epoch
    (kept for that epoch) or the run's tickets are spent (``total``).

    ``counter`` deals positions 0, 1, 2...: position i is ticket ``pending[i]`` while ``pending`` lasts
    (tickets not trained when the dealing restarted: a checkpoint's, a lost worker's), then ``base``
    onwards. Tickets drawn and not yet trained are held: ``held`` (drawn, in order), ``current`` (the step's,
    taken by :meth:`take`) and ``carry``. With ``publish`` (fault tolerance) the worker writes the tickets it
    holds into its row of the counter's slots, so the survivors of its loss can deal them again.

    ``block``: positions taken in one call on the counter (``data.chunks_per_draw``); those not yet drawn
    are ``ahead``, held as the others are. Fewer calls on the counter's host, whose service all workers
    share (one call a step each queued behind 60 others: benchmarks/README.md), at the price of a coarser
    share at an epoch's end: a worker holds up to ``block - 1`` chunks more than it trains yet."""

    def __init__(
        self,
        chunks: Chunks,
        counter: Counter,
        total: int,
        steps: int,
        rank: int = 0,
        publish: bool = False,
        block: int = 1,
    ):
        self.chunks, self.counter, self.total = chunks, counter, total
        self.steps, self.rank, self.publish = steps, rank, publish
        self.block = block
        assert 1 <= block <= HELD_SLOTS // 2, f"{block} chunks a draw: at most {HELD_SLOTS // 2}"
        self.ahead: deque[int] = deque()  # tickets of this worker's last block, not drawn yet
        self.base, self.pending = 0, []
        self.held: deque[int] = deque()
        self.current: int | None = None  # the ticket of the step in progress
        self.carry: int | None = None  # a ticket of a later epoch, drawn at the end of this one
        self.epoch = 0
        self.last_position = -1  # the last counter position this worker drew
        self.again = False  # restarted: the epoch's chunks may not all be dealt (:meth:`reopen`)
        self.members: list[int] | None = None  # the workers the counter's rows are for (None: as launched)
        self.seconds = 0.0  # spent on the counter (draws, published rows): the summary's control time

    def __len__(self) -> int:
        """Micro-batches of an epoch over all workers (each worker trains a share of them)."""
        return self.chunks.per_epoch * self.chunks.accumulate

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def restart(
        self, counter: Counter, base: int, pending: list[int], rank: int, members: list[int] | None = None
    ) -> None:
        """Deal anew from a fresh ``counter`` (made for the workers ``members``, launch ranks by rank).

        It deals ``pending`` first, then ``base`` onwards (this worker now ``rank``); the tickets this
        worker holds stay its own."""
        self.counter, self.base, self.pending, self.members = counter, base, sorted(pending), members
        self.rank, self.last_position, self.again = rank, -1, True
        self._publish()

    def reopen(self) -> bool:
        """Whether the dealing restarted since the last call.

        Then a worker whose epoch had ended (its draws spent) iterates again, for chunks dealt anew (a lost
        worker's) of this epoch."""
        again, self.again = self.again, False
        return again

    def undrawn(self, position: int) -> tuple[list[int], int]:
        """``(pending, base)`` of the tickets not drawn once the counter stands at ``position``."""
        return self.pending[position:], self.base + max(0, position - len(self.pending))

    def draw(self) -> int | None:
        """The next ticket: of this worker's block, else from the counter; None once the run's are spent."""
        if not self.ahead:
            self._draw_block()
        return self.ahead.popleft() if self.ahead else None

    def _draw_block(self) -> None:
        """Take :attr:`block` positions from the counter, in one call, into :attr:`ahead` as tickets."""
        from runner.comm.errors import PeerLost

        start = time.perf_counter()
        try:
            first = self.counter.fetch_add(0, self.block)
        except PeerLost:  # its host, worker 0, was lost: no more chunks for now; the survivors meet at the
            return  # epoch's end (Dynamic.end_of_span), recover, and deal what is left anew
        finally:
            self.seconds += time.perf_counter() - start
        self.last_position = first + self.block - 1
        for position in range(first, first + self.block):
            if position < len(self.pending):
                self.ahead.append(self.pending[position])
            elif (ticket := self.base + position - len(self.pending)) < self.total:
                self.ahead.append(ticket)
        if self.ahead:  # (published once: a ticket moved on to the loader or carried is held all the same)
            self._publish()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            ticket, self.carry = (self.carry, None) if self.carry is not None else (self.draw(), None)
            if ticket is None:
                return
            if self.chunks.epoch_of(ticket) > self.epoch:
                self.carry = ticket
                return
            self.held.append(ticket)
            yield from self.chunks.micro_batches(ticket)

    def steps_at(self, tickets: int) -> int:
        """The schedule's steps (``steps`` in all) once the run's first ``tickets`` chunks are trained.

        They count the chunks per worker as planned, whatever the workers lost since."""
        return tickets * self.steps // self.total

    def step_of(self, ticket: int | None) -> int:
        """The schedule's step for ``ticket``."""
        return 0 if ticket is None else self.steps_at(min(ticket, self.total - 1))

    def take(self) -> int:
        """The ticket of the step about to train (the oldest drawn, not yet trained)."""
        self.current = self.held.popleft()
        return self.current

    def trained(self) -> None:
        """The step of :attr:`current` is done."""
        self.current = None
        self._publish()

    def holding(self) -> list[int]:
        """The tickets this worker holds, drawn and not trained."""
        return sorted(t for t in (self.current, self.carry, *self.held, *self.ahead) if t is not None)

    def _publish(self) -> None:
        if self.publish:
            row = self.holding()
            assert len(row) <= HELD_SLOTS, f"a worker holds {len(row)} chunks, more than {HELD_SLOTS}"
            from runner.comm.errors import PeerLost

            start = time.perf_counter()
            try:
                self.counter.put(1 + self.rank * HELD_SLOTS, row + [-1] * (HELD_SLOTS - len(row)))
            except PeerLost:  # its host was lost with what the workers held (redeal says so)
                pass
            self.seconds += time.perf_counter() - start


def counter_slots(workers: int) -> int:
    """The number of slots of a dealer's counter.

    In order: the position, then :data:`HELD_SLOTS` per worker for the tickets it holds, then the workers'
    last decision (:class:`runner.rank.agreement.Board`), then the last validation by time claimed
    (``train.val_every_s``: its last slot)."""
    return 1 + workers * HELD_SLOTS + 2


def decision_slot(workers: int) -> int:
    """The counter's slot of the workers' last decision (the one before the last)."""
    return counter_slots(workers) - 2


def claim_slot(workers: int) -> int:
    """The counter's slot of the last validation by time claimed (its last)."""
    return counter_slots(workers) - 1


def held_rows(slots: list[int], workers: int) -> list[list[int]]:
    """The tickets each worker published, by its rank, from the counter's ``slots``."""
    rows = [slots[1 + r * HELD_SLOTS : 1 + (r + 1) * HELD_SLOTS] for r in range(workers)]
    return [[t for t in row if t >= 0] for row in rows]


class Meetings:
    """The ticket positions of each epoch where the workers meet, in order.

    They are agreement points every ``interval`` chunks, validations every ``val_chunks`` chunks (None: at
    epoch ends only), and the epoch's end (the last index). Every worker passes all of them, each epoch, in
    the same order."""

    def __init__(self, per_epoch: int, interval: int, val_chunks: int | None):
        agree = set(range(interval, per_epoch, interval))
        self.validations = set(range(val_chunks, per_epoch, val_chunks)) if val_chunks else set()
        self.positions = sorted(agree | self.validations)
        self.per_epoch = per_epoch
        self.count = len(self.positions) + 1  # the epoch's end is the last meeting

    def position(self, index: int) -> int:
        """The chunk of its epoch at which meeting ``index`` is (the epoch's end: ``per_epoch``)."""
        return self.positions[index] if index < len(self.positions) else self.per_epoch

    def gap(self, index: int) -> int:
        """Chunks between meeting ``index`` and the one before it (or the epoch's start)."""
        return self.position(index) - (self.position(index - 1) if index else 0)

    def passed_by(self, ticket: int) -> int:
        """How many of its epoch's meetings a worker has passed once it draws ``ticket``."""
        return bisect_right(self.positions, ticket % self.per_epoch)

    def validates(self, index: int) -> bool:
        """Whether meeting ``index`` of an epoch validates (the epoch's end: by ``train.val_every``)."""
        return index < len(self.positions) and self.positions[index] in self.validations


def val_chunks(val_every: float, per_epoch: int) -> int | None:
    """Chunks (or steps) between validations within an epoch for ``train.val_every`` below 1.

    None: at epoch ends only."""
    return max(1, round(val_every * per_epoch)) if val_every < 1 else None


def plan(chunks: Chunks, epochs: int, max_steps: int | None, workers: int) -> tuple[int, int, int]:
    """``(tickets, epochs, steps)`` of a dynamic run.

    ``tickets``: all epochs' chunks, cut at ``max_steps × workers``; ``steps``, the schedule's length,
    counts chunks per worker (ticket t is at step about t // workers)."""
    per_epoch = chunks.per_epoch
    total = epochs * per_epoch
    if max_steps is not None:
        total = min(total, max_steps * workers)
    return total, min(epochs, math.ceil(total / per_epoch)), math.ceil(total / workers)


def dealing_state(dealer: Dealer, workers: CommLike) -> dict[str, Any]:
    """Collective over the workers, at a meeting: what is left to deal, for a checkpoint.

    ``pending``: every ticket drawn and not trained (the ones the workers hold) or left pending; ``base``:
    the first never drawn."""
    position = workers.broadcast_object(dealer.counter.read()[0] if workers.rank == 0 else None)
    left, base = dealer.undrawn(position)
    held = [t for row in workers.allgather_object(dealer.holding()) for t in row]
    return {"pending": sorted(held + left), "base": base}


def redeal(dealer: Dealer, workers: CommLike, before: list[int], lost: list[int]) -> str | None:
    """Collective over the survivors of a loss: deal anew from a new counter over them.

    ``lost`` (launch ranks) were lost from the workers ``before`` (launch ranks, by old rank). The new
    counter deals the tickets the lost workers held, then what was never drawn. Worker 0 held the counter;
    if it was lost, what it held is gone: returns a line saying so (else None)."""
    # the rows of worker 0's counter are by the members it was made for: ``before``, or fewer when the
    # survivors dealt anew already in a recovery another loss cut short (then worker 0's view decides)
    members = dealer.members or before
    alive = {workers.launch_rank(r) for r in range(workers.size)}
    held = (dealer.counter.snapshot(), members) if members[0] in alive and workers.rank == 0 else None
    held = workers.broadcast_object(held)  # every survivor takes the same branch below
    slots, members = held if held is not None else (None, members)
    note = None
    if slots is not None:
        position, rows = slots[0], held_rows(slots, len(members))
        returned = [t for r, launch in enumerate(members) if launch not in alive for t in rows[r]]
    else:
        position, returned = max(workers.allgather_object(dealer.last_position)) + 1, []
        note = "the chunks lost worker 0 held (it held the counter) are not dealt again"
    left, base = dealer.undrawn(position)
    # A survivor at its epoch's end holds the next epoch's first chunk it drew (carry): back to the pool, so
    # the survivors first train this epoch's returned chunks, whichever of them draws them.
    # So do the chunks left of each survivor's block (none trained: the loader took none of them yet).
    mine = [t for t in (dealer.carry, *dealer.ahead) if t is not None]
    carried = [t for row in workers.allgather_object(mine) for t in row]
    dealer.carry = None
    dealer.ahead.clear()
    counter = workers.counter(counter_slots(workers.size))
    if slots is not None:  # the validations by time claimed so far stay claimed
        if workers.rank == 0:
            counter.put(claim_slot(workers.size), [slots[claim_slot(len(members))]])
        workers.barrier()
    dealer.counter.close()
    ranks = [workers.launch_rank(r) for r in range(workers.size)]
    dealer.restart(counter, base, returned + carried + left, workers.rank, ranks)
    return note


def regrow(dealer: Dealer, workers: CommLike, joined: bool) -> None:
    """Collective over the workers once new ones joined: deal anew from a new counter over all of them.

    ``joined``: this one is new. The new counter deals what was never drawn; the tickets each worker holds
    stay its own (a new one holds none). Worker 0 held the old counter and still comes first."""
    undrawn = dealer.undrawn(dealer.counter.snapshot()[0]) if workers.rank == 0 else None
    left, base = workers.broadcast_object(undrawn)
    counter = workers.counter(counter_slots(workers.size))
    if dealer.counter is not None:
        dealer.counter.close()
    dealer.restart(counter, base, left, workers.rank, [workers.launch_rank(r) for r in range(workers.size)])


def lost_shard(plans: list[tuple[int, int] | None], rank: int) -> tuple[int, int]:
    """Static shards, within an epoch: the shard a new worker takes for the rest of the epoch.

    ``rank`` is the new worker (its entry of ``plans`` None), and ``plans`` holds every worker's ``(shard,
    shards)`` (None: new). New workers take the lost workers' shards in order, then, once they are all
    taken, a copy of a survivor's (so its steps match the others')."""
    kept = [p for p in plans if p is not None]
    shards = kept[0][1]
    missing = sorted(set(range(shards)) - {shard for shard, _ in kept})
    j = [r for r, p in enumerate(plans) if p is None].index(rank)
    return (missing[j], shards) if j < len(missing) else (kept[j % len(kept)][0], shards)
