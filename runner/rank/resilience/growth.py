"""The loop's side of growing the job (:mod:`runner.rank.resilience.elastic`).

When to grow, and welcoming the new workers into the training."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runner.rank.state import Position, broadcast_state

if TYPE_CHECKING:
    from torch import nn

    from runner.rank.agreement import Decision
    from runner.rank.resilience.crew import Crew
    from runner.rank.resilience.recovery import Recovery


class Growth:
    """Growing the job from one worker.

    ``recovery``: its fault tolerance, which grows the job. The workers agree to grow at an agreement
    (:meth:`note`), grow at the next step's or epoch's start (:meth:`if_due`), and welcome the new workers.
    ``retry(fn, pos, *args)``: the loop's, recovering from lost workers."""

    def __init__(self, recovery: Recovery | None, crew: Crew, model: nn.Module, retry: Callable[..., Any]):
        self.recovery, self.crew, self.model, self.retry = recovery, crew, model, retry
        self.due = 0  # workers to add at the next step's start
        self.noted = 0  # the lost workers to replace when the workers agreed to grow
        self.carried = 0  # RUN_DIR/JOIN's workers agreed before a loss put their growth off (:meth:`put_off`)

    def note(self, decision: Decision) -> None:
        """At an agreement: the workers to add at the next step's start; the same on every worker.

        Lost ones to replace, and those ``RUN_DIR/JOIN`` asks for."""
        recovery = self.recovery
        if decision.polled and recovery is not None and recovery.elastic is not None:
            self.due = decision.join + self.carried + recovery.heal_pending
            self.noted, self.carried = recovery.heal_pending, 0

    def joins_agreed(self) -> int:
        """The workers ``RUN_DIR/JOIN`` asked for that the workers agreed to add and have not added yet."""
        return self.carried + self.due - self.noted  # (due counts the noted lost workers too)

    def put_off(self, joins: int) -> None:
        """After a loss, on every survivor: a growth agreed and not under way waits for the next agreement.

        ``joins``: the most :meth:`joins_agreed` of any survivor. The survivors may stand at different
        places (dynamic assignment: one whose draws are spent at its next meeting, another at its next step;
        one past the agreement, one not yet there), so one growing at once would wait for the others in
        another collective. The recovery forces an agreement, which every survivor reaches: the growth is
        agreed again there, for the lost workers too (:attr:`Recovery.heal_pending`)."""
        elastic = self.recovery.elastic if self.recovery is not None else None
        if elastic is None or elastic.under_way:  # (every survivor is in the growth: it is done again now)
            return
        self.carried, self.due, self.noted = joins, 0, 0

    def if_due(self, pos: Position, mid_epoch: bool) -> None:
        """Grow the job when the workers agreed to and the rule is ready (DiLoCo: at a round's start)."""
        if self.due and self.crew.rule.ready_to_grow:
            self.retry(self.grow, pos, mid_epoch)

    def grow(self, pos: Position, mid_epoch: bool) -> None:
        """Collective over the workers and servers: spawn the new workers into the job and welcome them."""
        start, recovery = time.time(), self.recovery
        if not self.due and not recovery.elastic.under_way:
            return  # a loss put it off (:meth:`put_off`) before every worker was in it
        self.crew.control.close()  # the agreement in flight (every worker started it)
        self.crew.rule.before_grow()
        # (workers lost since the agreement, in a growth they cut short: replaced too, the same on every one)
        ids = recovery.elastic.grow(self.due + recovery.heal_pending - self.noted, near=recovery.heal_hosts)
        self.due, self.noted, recovery.heal_pending, recovery.heal_hosts = 0, 0, 0, []
        self.welcome(pos, mid_epoch, joined=False)
        recovery.elastic.under_way = False
        refusal = recovery.elastic.refusal
        if refusal and self.crew.workers.rank == 0:
            self.crew.meter.echo(f"warning: {refusal}")
        if ids:
            line = recovery.elastic.record(ids, pos.step)
            seconds = time.time() - start
            size = self.crew.workers.size
            self.crew.log.write("joined", pos.step, joined=ids, workers=size, seconds=round(seconds, 4))
            self.crew.meter.echo(f"{line} (in {seconds:.2f} s)")

    def welcome(self, pos: Position, mid_epoch: bool, joined: bool) -> tuple[Position, bool]:
        """Collective over the workers once the job grew (``joined``: this worker is one of the new ones).

        Worker 0 gives the new ones its state and position, the data is dealt anew among all, the rule
        grows, and the workers agree on their next agreement. Returns where the new ones start, and
        whether that is within an epoch (they then take the lost workers' shards of it)."""
        c = self.crew
        w = c.workers
        sub = w.split(0 if w.rank == 0 or joined else 1, keep=False)
        if w.rank == 0 or joined:
            if sub.size > 1:
                broadcast_state(self.model, sub, root=0)
                package = sub.broadcast_object(c.state.package(pos, mid_epoch) if w.rank == 0 else None)
                if joined:
                    pos, mid_epoch = c.state.unpack(package)
                    c.meter.rebase()  # (it took worker 0's records: its own samples count from here)
        sub.free()
        c.validator.resend(record=True)  # (worker 0 stays worker 0)
        c.pace.welcome(joined, mid_epoch)  # the data dealt anew among all
        c.rule.grow(joined)
        c.validator.regrow()
        c.meter.world = w.size
        after = c.pace.agreement_after(pos.step)
        c.control.reset(int(w.allreduce_values([after], "max")[0]))
        return pos, mid_epoch
