"""How a worker's steps are paced through an epoch: by its static shard, or by the chunks a dealer deals it.

:class:`Static` or :class:`Dynamic` (``data.assignment=dynamic``): the loop chooses one at construction and
calls it at the same points, with no branch of its own on which it is:

* :meth:`~Static.begin_epoch` deals the epoch's data and says the run's steps;
* :meth:`~Static.before_step` (True: the span ends), :meth:`~Static.start_step`, :meth:`~Static.after_step`
  (the progress shown);
* :meth:`~Static.at_step_end` (True: the span ends), where static shards validate, agree, checkpoint;
* :meth:`~Static.end_of_span` (True: train the epoch again), where dynamic assignment meets at its end;
* :meth:`~Static.end_of_epoch`, the progress reached;
* and what the training state, recovery and growth ask of it (the shard, what is left to deal, the next
  agreement, the data anew after a loss or a growth).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.rank.agreement import settle
from runner.rank.assignment import (
    CHUNKS_PER_WORKER,
    Dealer,
    Meetings,
    dealing_state,
    lost_shard,
    redeal,
    regrow,
    val_chunks,
)
from runner.rank.state import Owner, Position, run_length

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.data import DataLoader

    from runner.comm.face import CommLike
    from runner.rank.agreement import Control, Decision
    from runner.rank.records.meter import Meter
    from runner.rank.validator import Validator
    from runner.schedule import Schedule
    from runner.schema.sections import TrainConfig


@dataclass
class Given:
    """What a pace is given by the loop that holds it.

    ``decide(pos, decision, due)``: at an agreement, validate by time, note a growth, checkpoint when asked
    or ``due``; True when the workers agreed to stop. ``retry(fn, pos, *args)``: ``fn(pos, *args)``,
    recovering from lost workers and calling it again. ``grow(pos)``: grow the job now if the workers agreed
    to (dynamic assignment grows right after the meeting that agreed it)."""

    cfg: TrainConfig
    loader: DataLoader
    workers: CommLike
    model: nn.Module
    schedule: Schedule
    meter: Meter
    validator: Validator
    control: Control
    decide: Callable[[Position, Decision, bool], bool]
    retry: Callable[..., Any]
    grow: Callable[[Position], None]


class PaceState(Owner):
    """The pace's part of a worker's training state, by key: computed when asked, given back at a position.

    ``shard``: the sampler's split (static shards); ``deal``: what is left to deal and the meetings passed
    (dynamic assignment; collective over the workers, so a use takes only the keys it carries);
    ``dealing``: the dealer's plan as it is (a joining worker's package)."""

    STATE = ("shard", "deal", "dealing")

    def state_dict(self, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
        take = {"shard": self.shard, "deal": self.left_to_deal, "dealing": self.dealing}
        return {key: take[key]() for key in keys or self.STATE}

    def load_state_dict(self, state: dict[str, Any], pos: Position | None = None) -> None:
        """Take back what :meth:`state_dict` returned, or a part of it, for training at ``pos``."""
        pos = pos or Position()
        give = {
            "shard": lambda v: self.take_shard(v, pos),
            "deal": lambda v: self.deal_rest(v, pos),
            "dealing": self.take_dealing,
        }
        for key, value in state.items():
            give[key](value)

    def shard(self) -> list[int] | None:
        raise NotImplementedError

    def take_shard(self, shard: list[int] | None, pos: Position) -> None:
        raise NotImplementedError

    def left_to_deal(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def deal_rest(self, deal: dict[str, Any] | None, pos: Position) -> None:
        raise NotImplementedError

    def dealing(self) -> tuple | None:
        raise NotImplementedError

    def take_dealing(self, dealing: tuple | None) -> None:
        raise NotImplementedError


class Static(PaceState):
    """Static shards: this worker's shard of each epoch (``DistributedSampler``).

    The same number of steps on every worker; the workers agree after every step (an interval of them,
    asynchronous rules). With ``replan`` (fault tolerance) the run's steps are planned anew at each epoch's
    start."""

    ahead = True  # on a GPU the next step's batch is copied while this one computes
    TRANSIENT = {
        "given": "what the loop gives it",
        "replan": "set at construction from train.fault_tolerance",
        "shard_plan": "given back as 'shard', the split a resumed or joined worker's epoch takes",
        "val_steps": "planned anew at each epoch's start",
    }

    def __init__(self, given: Given, replan: bool = False):
        self.given, self.replan = given, replan
        self.shard_plan: tuple[int, int] | None = None  # a resumed epoch's split of the data, if not ours
        self.val_steps: int | None = None  # steps between validations within the epoch

    def begin_epoch(self, pos: Position, epochs: int, start: Position, max_steps: int) -> int:
        """Deal epoch ``pos.epoch``'s shard from ``pos.batch`` on; returns the run's steps.

        The survivors of a lost worker re-plan them with their longer epochs."""
        g, cfg = self.given, self.given.cfg
        sampler = g.loader.sampler
        plan = self.shard_plan if pos.epoch == start.epoch and self.shard_plan else None
        sampler.reshard(*(plan or (g.workers.rank, g.workers.size)))
        if self.replan:  # fault tolerance: survivors have longer epochs
            done = pos.step - pos.batch
            _, max_steps = run_length(epochs, cfg.max_steps, self.steps_per_epoch(), pos.epoch, done)
            if max_steps != g.schedule.total_steps:
                g.schedule.replan(max_steps)
                g.meter.replan(max_steps)
        sampler.set_epoch(pos.epoch)
        sampler.start_at(pos.batch * cfg.batch_size * cfg.accumulate)
        self.val_steps = val_chunks(cfg.val_every, self.steps_per_epoch())
        return max_steps

    def steps_per_epoch(self) -> int:
        return len(self.given.loader) // self.given.cfg.accumulate

    def before_step(self, pos: Position) -> bool:
        return False

    def cut_at(self, pos: Position, max_steps: int) -> float | None:
        """The part of the epoch trained where ``train.max_steps`` ended the run before its last batch.

        None where it did not."""
        steps = self.steps_per_epoch()
        return pos.batch / steps if pos.step >= max_steps and pos.batch < steps else None

    def start_step(self) -> None:
        pass

    def schedule_step(self, pos: Position) -> int:
        """The step whose learning rate the schedule sets."""
        return pos.step

    def after_step(self) -> int | None:
        """The run's progress to show (None: the loop's step count)."""
        return None

    def at_step_end(self, pos: Position, max_steps: int) -> bool:
        """Validate, agree and checkpoint when due; True when the span ends (a stop, or the run's end)."""
        return self.given.retry(self.agree, pos) or pos.step >= max_steps

    def agree(self, pos: Position) -> bool:
        """Validate within the epoch when due, then checkpoint when asked; True when asked to stop.

        A checkpoint is taken when the workers agree or the step count asks (every worker decides alike); the
        launcher asks to stop."""
        g, every, steps = self.given, self.val_steps, self.steps_per_epoch()
        if every and pos.batch % every == 0 and pos.batch < steps:
            g.validator.validate(pos.epoch, pos.step, done=pos.batch / steps)
            g.model.train()
        return g.decide(pos, g.control.poll(pos.step), g.control.checkpointer.due(pos.step))

    def end_of_span(self, pos: Position) -> bool:
        return False

    def end_of_epoch(self, epoch: int) -> None:
        """Every worker is past the epoch's end."""

    def checkpoint_step(self, pos: Position) -> int:
        """The step a checkpoint is named by."""
        return pos.step

    def checkpoint_words(self, step: int, pos: Position) -> str:
        """The console's line for a checkpoint after ``step``.

        At an epoch's start it is the end of the one before (a run's last is at the start of an epoch it does
        not have)."""
        if pos.batch == 0 and pos.epoch > 0:
            return f"checkpoint after step {step} (end of epoch {pos.epoch - 1})"
        return f"checkpoint after step {step} (epoch {pos.epoch}, batch {pos.batch})"

    def agreement_after(self, step: int) -> int:
        """The first step after ``step`` at which the workers agree on checkpoints and stops."""
        interval = self.given.control.interval
        return (step // interval + 1) * interval

    # -- the training state (runner/rank/trainer_state.py) ---------------------------------------------------
    def shard(self) -> list[int] | None:
        sampler = self.given.loader.sampler
        return [sampler.rank, sampler.num_replicas]

    def take_shard(self, shard: list[int] | None, pos: Position) -> None:
        if pos.batch > 0 and shard:  # a resumed epoch goes on over the checkpoint's shards
            self.shard_plan = (shard[0], shard[1])

    def left_to_deal(self) -> dict[str, Any] | None:
        return None

    def deal_rest(self, deal: dict[str, Any] | None, pos: Position) -> None:
        if deal:
            raise ValueError(
                f"the checkpoint after step {pos.step} was written with data.assignment=dynamic: resume it "
                "with data.assignment=dynamic"
            )

    def dealing(self) -> tuple | None:
        return None

    def take_dealing(self, dealing: tuple | None) -> None:
        assert dealing is None, "a package of dynamic assignment for a worker of static shards"

    # -- recovery and growth (runner/rank/resilience/) -----------------------------------------------------
    def rejoin(self, before: list[int], lost: list[int]) -> None:
        """Workers were lost: this epoch each survivor finishes its own shard (the next is dealt anew)."""

    def welcome(self, joined: bool, mid_epoch: bool) -> None:
        """Collective once the job grew: a new worker takes a lost worker's shard of the epoch."""
        w, sampler = self.given.workers, self.given.loader.sampler
        plans = w.allgather_object(None if joined else (sampler.rank, sampler.num_replicas))
        if joined and mid_epoch:
            self.shard_plan = lost_shard(plans, w.rank)


class Dynamic(PaceState):
    """Dynamic assignment: this worker trains the chunks its dealer draws from the counter all workers share.

    It draws until the epoch's are spent; the workers meet at fixed positions of the epoch (agreement points,
    validations, its end), which each passes as its next chunk comes after them."""

    ahead = False  # drawing the next batch ahead would hold a chunk of the shared counter's
    TRANSIENT = {
        "given": "what the loop gives it",
        "dealer": "its counter is the job's; what is left to deal is carried as 'deal' and 'dealing'",
        "meetings": "carried in 'dealing'; a resumed job plans it from its config, as the original did",
        "passed": "carried in 'deal' and 'dealing'",
        "meetings_done": "carried in 'deal' and 'dealing'",
        "stopped": "a job that agreed to stop has stopped: a resumed one starts not stopped",
    }

    def __init__(self, given: Given, dealer: Dealer):
        self.given, self.dealer = given, dealer
        per_epoch = dealer.chunks.per_epoch
        val = val_chunks(given.cfg.val_every, per_epoch)
        self.meetings = Meetings(per_epoch, CHUNKS_PER_WORKER * given.workers.size, val)
        self.passed = 0  # meetings of this epoch passed
        self.meetings_done = 0  # meetings of the run passed (the stop/checkpoint agreement's count)
        self.stopped = False  # the workers agreed to stop

    def begin_epoch(self, pos: Position, epochs: int, start: Position, max_steps: int) -> int:
        """The dealer deals epoch ``pos.epoch``; it ends the run when the tickets are spent."""
        self.dealer.set_epoch(pos.epoch)
        return sys.maxsize

    def before_step(self, pos: Position) -> bool:
        """Pass the meetings before the chunk this worker is about to train; True when they agreed to stop."""
        return self.given.retry(self.meet, pos, self.dealer.take())

    def start_step(self) -> None:
        """The step starts now: a meeting or a growth before it is not the step's time."""
        self.given.meter.restart_step()

    def schedule_step(self, pos: Position) -> int:
        """The step whose learning rate the schedule sets: the run's, at this chunk."""
        return self.dealer.step_of(self.dealer.current)

    def after_step(self) -> int | None:
        """The run's progress, in steps of all workers' chunks."""
        shown = self.dealer.step_of(self.dealer.current) + 1
        self.dealer.trained()
        return shown

    def at_step_end(self, pos: Position, max_steps: int) -> bool:
        return False

    def cut_at(self, pos: Position, max_steps: int) -> float | None:
        """None: what is left to deal is in the checkpoint's dealing state."""
        return None

    def end_of_span(self, pos: Position) -> bool:
        """At the epoch's end (where a loss may be noticed): pass its last meetings.

        True when chunks were dealt anew after this worker's draws were spent (a lost worker's), to be
        trained now. Under fault
        tolerance the workers first meet in a barrier: the meetings are one-sided (the counter's), so a
        worker lost holding chunks could otherwise be noticed only after the epoch, too late to train them
        in it (and, in the last epoch, at all). The meeting is ULFM's agreement (:func:`settle`), which all
        survivors leave alike: a barrier a lost worker had entered could let some go on to the epoch's
        records while the others trained the chunks dealt anew, each waiting for the other."""
        if self.stopped:
            return False
        self.given.retry(self.meet, pos, None)
        if self.dealer.publish:
            self.given.retry(self._all_here, pos)
        return self.dealer.reopen()

    def _all_here(self, pos: Position) -> None:
        settle(self.given.workers, meet=True)

    def meet(self, pos: Position, ticket: int | None) -> bool:
        """Pass the meetings of this epoch that come before ``ticket``; True when the workers agreed to stop.

        ``ticket`` is the one this worker is about to train (None: the epoch has ended, pass them all); at
        each meeting, validate when due, and checkpoint or stop as the workers agreed."""
        g, meetings, chunks = self.given, self.meetings, self.dealer.chunks
        alone, validator = g.validator.alone, g.validator
        if g.workers.rank == 0 and alone:
            validator.collect()
        if ticket is not None and g.cfg.val_every_s is not None and alone:
            validator.claim(pos)
        if ticket is None:
            upto = meetings.count
        else:
            upto = meetings.passed_by(ticket) if chunks.epoch_of(ticket) == pos.epoch else self.passed
        while self.passed < upto:
            k, self.passed, self.meetings_done = self.passed, self.passed + 1, self.meetings_done + 1
            position = pos.epoch * chunks.per_epoch + meetings.position(k)
            # (a run that max_steps ends within the epoch passes the epoch's later meetings unvalidated)
            if meetings.validates(k) and not alone and position < self.dealer.total:
                validator.validate(pos.epoch, pos.step, done=meetings.position(k) / chunks.per_epoch)
                g.model.train()
            elif meetings.validates(k) and ticket == position:
                validator.validate_alone(pos)  # this worker drew the validation's chunk: the free one
            if self.agree(pos, position - meetings.gap(k), position):
                return True
            # a growth agreed here is taken here by every worker: one whose draws are spent passes the
            # epoch's later meetings in this call, and would poll the next while the others grow
            g.grow(pos)
        return False

    def agree(self, pos: Position, before: int, position: int) -> bool:
        """At a meeting at ticket ``position`` (the previous at ``before``); True when they agreed to stop.

        Validate by time, note a growth, checkpoint or stop as the workers agreed."""
        control, steps = self.given.control, self.dealer.steps_at
        decision = control.poll(self.meetings_done)
        due = control.checkpointer.due_between(steps(before), steps(position))
        self.stopped = self.given.decide(pos, decision, due)
        return self.stopped

    def end_of_epoch(self, epoch: int) -> None:
        """Every worker is past the epoch's end (its records were reduced over all): the progress reached."""
        ends = min((epoch + 1) * self.dealer.chunks.per_epoch, self.dealer.total)
        self.given.meter.reach(self.dealer.steps_at(ends), epoch)
        self.passed = 0

    def checkpoint_step(self, pos: Position) -> int:
        """The step a checkpoint is named by: rank 0's (each worker is at its own)."""
        return int(self.given.workers.broadcast_object(pos.step))

    def checkpoint_words(self, step: int, pos: Position) -> str:
        """The console's line for a checkpoint after worker 0's ``step``.

        The progress bar counts the run's steps (all workers' chunks), which a fast worker 0 is ahead of and
        a slow one behind."""
        run, total = self.given.meter.shown_step, self.given.meter.total_steps
        return f"checkpoint after step {step} (worker 0's own steps; the run's: {run} of {total})"

    def agreement_after(self, step: int) -> int:
        """The next agreement: the workers agree at meetings, counted."""
        return self.meetings_done + 1

    # -- the training state (runner/rank/trainer_state.py) ---------------------------------------------------
    def shard(self) -> list[int] | None:
        return None

    def take_shard(self, shard: list[int] | None, pos: Position) -> None:
        pass

    def left_to_deal(self) -> dict[str, Any] | None:
        """Collective over the workers: what is left to deal, and the meetings passed."""
        deal = dealing_state(self.dealer, self.given.workers)
        return {**deal, "meetings": self.meetings_done, "passed": self.passed}

    def deal_rest(self, deal: dict[str, Any] | None, pos: Position) -> None:
        """Deal what the checkpoint's workers had not trained: its ``pending`` tickets, then from ``base``."""
        if deal is None:
            raise ValueError(
                f"the checkpoint after step {pos.step} was written with data.assignment=static: resume it "
                "with data.assignment=static"
            )
        self.dealer.base, self.dealer.pending = deal["base"], list(deal["pending"])
        self.meetings_done, self.passed = deal["meetings"], deal["passed"]

    def dealing(self) -> tuple | None:
        return (self.dealer.total, self.dealer.steps, self.meetings, self.meetings_done, self.passed)

    def take_dealing(self, dealing: tuple | None) -> None:
        total, steps, self.meetings, self.meetings_done, self.passed = dealing
        self.dealer.total, self.dealer.steps = total, steps

    # -- recovery and growth (runner/rank/resilience/) -----------------------------------------------------
    def rejoin(self, before: list[int], lost: list[int]) -> None:
        """Collective over the survivors: the lost workers' chunks go back to the pool."""
        workers = self.given.workers
        note = redeal(self.dealer, workers, before, lost)
        if note and workers.rank == 0:
            self.given.meter.echo(f"warning: {note}")

    def welcome(self, joined: bool, mid_epoch: bool) -> None:
        """Collective once the job grew: the dealing starts over among all workers."""
        regrow(self.dealer, self.given.workers, joined)


#: The pace of a loop's steps (the loop chooses one at its start).
Pace = Static | Dynamic
