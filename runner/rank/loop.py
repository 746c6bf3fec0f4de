"""The one training loop that serves every synchronization rule."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from runner.comm import Comm, PeerLost
from runner.rank.agreement import Control
from runner.rank.assignment import (
    CHUNKS_PER_WORKER,
    Dealer,
    Meetings,
    val_chunks,
)
from runner.rank.guard import Diverged, Guard, fell_to_chance
from runner.rank.prefetch import Batch, Prefetch
from runner.rank.records.heartbeat import Heartbeat
from runner.rank.records.meter import Meter
from runner.rank.records.metrics import MetricsLog
from runner.rank.records.summary import Outcome, summary
from runner.rank.resilience.growth import Growth
from runner.rank.resilience.survivor import Survivors
from runner.rank.state import Position, run_length
from runner.rank.trainer_state import TrainerState
from runner.rank.validation import autocast
from runner.rank.validator import Validator
from runner.results import no_improvement
from runner.rules.base import Rule
from runner.schema.sections import TrainConfig
from runner.tasks import Task

if TYPE_CHECKING:
    from runner.rank.resilience.recovery import Recovery
    from runner.schedule import Schedule


def grouped(batches: Iterable[Batch], k: int) -> Iterator[list[Batch]]:
    """Consecutive groups of ``k`` batches (the micro-batches of one accumulated step); an incomplete last
    group is dropped."""
    group: list[Batch] = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []


@dataclass
class Parts:
    """What is trained, and how: the model, its optimizer, the synchronization rule, the task (loss and
    metrics) and the learning-rate schedule."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    rule: Rule
    task: Task
    schedule: Schedule


def delay(seconds: float, spin: bool) -> None:
    """Sleep ``seconds``, or with ``spin`` keep the CPU busy that long (as computing would)."""
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass
class Place:
    """Where a worker trains: its communicator with the other workers (``workers.stats`` accounts its
    communication), its device, and ``delay_s`` slept (or with ``spin``, spent spinning) at the start of
    every step (a simulated straggler)."""

    workers: Comm
    device: torch.device
    delay_s: float = 0.0
    spin: bool = False


@dataclass
class Records:
    """What the loop reports to and agrees through: ``metrics.jsonl``, the meter (timing and progress),
    the heartbeat, the workers' agreement on checkpoints and stops (``control``, with its checkpointer),
    and the validation metric the run reports (``monitor``: early stopping watches it)."""

    log: MetricsLog
    meter: Meter
    beat: Heartbeat
    control: Control
    monitor: str = "val_acc"


class Trainer:
    """Trains ``parts.model`` on this rank's shard (``loaders``: train and validation), handing control to
    the rule at its hooks.

    A step is ``cfg.accumulate`` loader batches (micro-batches): their gradients are summed, each loss
    divided by their number, and the rule exchanges once per step (BSP: its buckets are all-reduced during
    the last micro-batch's backward). The schedule sets the learning rate before every optimizer step.
    With ``cfg.precision`` bf16 or fp16 the forward passes run under autocast; fp16 scales the loss with a
    gradient scaler (a step whose gradients overflow is skipped and the scale halved). ``records.control``
    says, at the same step on every worker, when to checkpoint or stop. With ``recovery`` (fault
    tolerance) a lost worker is survived: recovery works through the loop's :class:`Survivors
    <runner.rank.resilience.survivor.Survivors>`, and the job grows through its :class:`Growth
    <runner.rank.resilience.growth.Growth>`.

    A GPU step waits for no host synchronisation: its loss stays on the device (``last_loss``, summed by the
    meter), the guard's deferred checks are read every ``cfg.log_every`` steps (every worker of a
    synchronous rule at the same steps) and before every validation, checkpoint and epoch record, and the
    next step's batch is copied on a side stream while this one computes (:class:`Prefetch`).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        parts: Parts,
        loaders: tuple[DataLoader, DataLoader],
        place: Place,
        records: Records,
        recovery: Recovery | None = None,
    ):
        self.cfg, self.recovery = cfg, recovery
        self.model, self.optimizer, self.rule = parts.model, parts.optimizer, parts.rule
        self.task, self.schedule, self.monitor = parts.task, parts.schedule, records.monitor
        self.workers, self.device = place.workers, place.device
        self.delay_s, self.spin = place.delay_s, place.spin
        self.log, self.meter = records.log, records.meter
        self.beat, self.control = records.beat, records.control
        self.train_loader, val_loader = loaders
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16" else None
        self.stopped_early: int | None = None  # the epoch after which early stopping ended training
        self.shard_plan: tuple[int, int] | None = None  # a resumed epoch's split of the data, if not ours
        keep = cfg.on_nonfinite == "skip" or recovery is not None  # a step may be dropped or redone
        fp16 = self.scaler is not None
        rank = lambda: self.workers.rank  # noqa: E731 (recovery gives the survivors new ranks)
        self.guard = Guard(
            self.model, self.optimizer, self.rule, cfg.on_nonfinite, keep, fp16, self.meter.echo, rank
        )
        self.preempted = False
        self.first_step = 0
        self.last_loss: float | torch.Tensor = float("nan")  # the last step's, left on the device (detached)
        self.prefetch = Prefetch(self.device)
        # dynamic assignment (data.assignment): the dealer of this worker's chunks, the epoch's meetings
        sampler = getattr(self.train_loader, "batch_sampler", None)
        self.dealer: Dealer | None = sampler if isinstance(sampler, Dealer) else None
        self.meetings: Meetings | None = None
        if self.dealer is not None:
            per_epoch = self.dealer.chunks.per_epoch
            val = val_chunks(cfg.val_every, per_epoch)
            self.meetings = Meetings(per_epoch, CHUNKS_PER_WORKER * self.workers.size, val)
        kept = (self.log, self.meter, self.guard)
        parts_ = (self.model, self.rule, self.task)
        self.validator = Validator(cfg, parts_, self.workers, self.device, kept, val_loader, self.dealer)
        by_claim = self.validator.alone  # the free worker claims a validation by time
        timed = self.cfg.val_every_s is not None and not by_claim
        if self.control is not None:
            self.control.validation_due = self.validator.due_by_time if timed else None
        self.val_steps: int | None = None  # static shards: steps between validations within the epoch
        self.passed = 0  # meetings of this epoch passed
        self.meetings_done = 0  # meetings of the run passed (the stop/checkpoint agreement's count)
        self.state = TrainerState(self)  # its three uses: checkpoint, a joining worker's package, a share
        self.survivors = Survivors(self)  # what recovery asks of the loop (fault tolerance)
        self.growth = Growth(self, self.survivors)  # the job grows (fault_tolerance=heal, RUN_DIR/JOIN)

    def fit(self, max_steps: int, epochs: int, start: Position) -> tuple[nn.Module, dict[str, Any]]:
        """Train from ``start``; returns the model the run reports (the rule's first evaluated model) and the
        results. Stops early, after a checkpoint, when the launcher asks (``self.preempted``)."""
        pos, reported, v = Position(start.step, start.epoch, start.batch), self.model, self.validator
        self.first_step, dealt = start.step, self.dealer is not None
        for epoch in range(start.epoch, epochs):
            pos.epoch = epoch
            self.growth.if_due(pos, mid_epoch=False)
            max_steps = self.begin_epoch(pos, epochs, start, max_steps)
            self.model.train()
            self.train_span(pos, epoch, max_steps)
            while dealt and not self.preempted:
                self.tolerant(self.meet, pos, None)  # the epoch's end (where a loss may be noticed)
                if not self.dealer.reopen():  # chunks dealt anew after this worker's draws were spent
                    break
                self.train_span(pos, epoch, max_steps)
            if self.preempted:
                self.meter.epoch_done()
                break
            span = self.meter.epoch_done()
            reported = self.tolerant(self.end_epoch, pos, epochs, span) or reported
            if dealt:  # every worker is past the epoch's end (its records were reduced over all)
                ends = min((epoch + 1) * self.dealer.chunks.per_epoch, self.dealer.total)
                self.meter.reach(self.dealer.steps_at(ends), epoch)
            pos.batch, self.passed = 0, 0
            if no_improvement(v.history, v.reported_prefix + self.monitor, self.cfg.early_stop):
                self.stopped_early = epoch
                self.meter.echo(
                    f"early stop after epoch {epoch}: {self.monitor} did not improve in the last "
                    f"{self.cfg.early_stop} validations"
                )
                break
        self.meter.close()
        classes = None if self.preempted else getattr(self.task, "num_classes", None)
        why = fell_to_chance(v.history, v.reported_prefix, classes, self.cfg.collapse_margin)
        if why is not None:  # ended at chance, after being well above it (before its final checkpoint)
            raise Diverged(f"step {pos.step}: {why}; {self.guard.kept_checkpoint()}")
        self.tolerant(self.end, pos, epochs, start)
        fp16 = self.scaler is not None
        outcome = Outcome(v.history, v.reported_prefix, self.monitor, self.stopped_early, fp16)
        return reported, summary(outcome, epochs, pos.step, self.meter, self.guard, self.workers)

    def train_span(self, pos: Position, epoch: int, max_steps: int) -> None:
        """Train the epoch's batches from the loader (dynamic assignment: until this worker's draws are
        spent), up to ``max_steps``, a stop, or (static shards) a step that ends the run."""
        dealt = self.dealer is not None
        # on a GPU, static shards: the next step's batch is copied while this one computes (dynamic
        # assignment: not, since drawing it ahead would hold a chunk of the shared counter's)
        groups = self.prefetch(grouped(self.train_loader, self.cfg.accumulate), ahead=not dealt)
        for micro in self.meter.batches(groups):
            if pos.step >= max_steps or (dealt and self.tolerant(self.meet, pos, self.dealer.take())):
                return
            self.growth.if_due(pos, mid_epoch=True)
            if dealt:
                self.meter.restart_step()
            while not self.step(micro, pos):
                pass
            pos.step, pos.batch, shown = pos.step + 1, pos.batch + 1, None
            if dealt:  # the run's progress, in steps of all workers' chunks
                shown = self.dealer.step_of(self.dealer.current) + 1
                self.dealer.trained()
            self.beat.progress(pos.step)
            if pos.step % self.cfg.log_every == 0:  # deferred non-finite checks: read before the record
                self.guard.check()
            samples = sum(len(x) for x, _ in micro)
            lr = self.optimizer.param_groups[0]["lr"]
            self.meter.step_done(pos.step, epoch, self.last_loss, samples, lr, shown)
            if not dealt and (self.tolerant(self.at_step_end, pos) or pos.step >= max_steps):
                return

    def begin_epoch(self, pos: Position, epochs: int, start: Position, max_steps: int) -> int:
        """Deal epoch ``pos.epoch``'s data (static shards: this worker's, from ``pos.batch`` on); returns the
        run's steps, which the survivors of a lost worker re-plan with their longer epochs (static)."""
        if self.dealer is not None:  # the dealer ends the run when the tickets are spent
            self.dealer.set_epoch(pos.epoch)
            return sys.maxsize
        sampler = self.train_loader.sampler
        plan = self.shard_plan if pos.epoch == start.epoch and self.shard_plan else None
        sampler.reshard(*(plan or (self.workers.rank, self.workers.size)))
        if self.recovery is not None:  # survivors: longer epochs
            steps_per_epoch = len(self.train_loader) // self.cfg.accumulate
            done = pos.step - pos.batch
            _, max_steps = run_length(epochs, self.cfg.max_steps, steps_per_epoch, pos.epoch, done)
            if max_steps != self.schedule.total_steps:
                self.schedule.replan(max_steps)
                self.meter.replan(max_steps)
        sampler.set_epoch(pos.epoch)
        sampler.start_at(pos.batch * self.cfg.batch_size * self.cfg.accumulate)
        self.val_steps = val_chunks(self.cfg.val_every, len(self.train_loader) // self.cfg.accumulate)
        return max_steps

    def meet(self, pos: Position, ticket: int | None) -> bool:
        """Dynamic assignment: pass the meetings of this epoch that come before ``ticket``, the one this
        worker is about to train (None: the epoch has ended, pass them all); at each, validate when due,
        and checkpoint or stop as the workers agreed. True when they agreed to stop."""
        meetings, chunks = self.meetings, self.dealer.chunks
        if self.workers.rank == 0 and self.rule.solo_validation:
            self.validator.collect()
        if ticket is not None and self.cfg.val_every_s is not None and self.rule.solo_validation:
            self.validator.claim(pos)
        if ticket is None:
            upto = meetings.count
        else:
            upto = meetings.passed_by(ticket) if chunks.epoch_of(ticket) == pos.epoch else self.passed
        while self.passed < upto:
            k, self.passed, self.meetings_done = self.passed, self.passed + 1, self.meetings_done + 1
            position = pos.epoch * chunks.per_epoch + meetings.position(k)
            if meetings.validates(k) and not self.rule.solo_validation:
                self.validator.validate(pos.epoch, pos.step)
                self.model.train()
            elif meetings.validates(k) and ticket == position:
                self.validator.validate_alone(
                    pos
                )  # this worker drew the validation's chunk: it is the free one
            decision = self.control.poll(self.meetings_done)
            if decision.validate:
                self.validator.by_time(pos)
            self.growth.note(decision)
            steps = self.dealer.steps_at
            due = self.control.checkpointer.due_between(steps(position - meetings.gap(k)), steps(position))
            if decision.stop or decision.checkpoint or due:
                self.preempted = decision.stop
                self.save(pos, False)
            if self.preempted:
                return True
        return False

    def step(self, micro: list[Batch], pos: Position) -> bool:
        """One training step on its micro-batches; False when it must be redone (workers were lost during
        it)."""
        applied = False
        if self.delay_s:
            delay(self.delay_s, self.spin)
        try:
            self.rule.before_step(pos.step)
            self.schedule.apply(pos.step if self.dealer is None else self.dealer.step_of(self.dealer.current))
            self.optimizer.zero_grad(set_to_none=False)
            self.guard.keep()
            scale = self.rule.loss_scale / len(micro)
            losses = []
            for i, (x, y) in enumerate(micro):
                self.rule.micro_batch(last=i == len(micro) - 1)
                loss = self.forward(x, y, first=pos.step == self.first_step and i == 0)
                scaled = self.guard.poison(loss, scale)
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
                losses.append(loss.detach())
            loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
            self.rule.after_backward(pos.step)
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.guard.allows(loss, pos.step):
                if self.cfg.grad_clip is not None:
                    nn.utils.clip_grad_norm_(self.guard.params, self.cfg.grad_clip, foreach=True)
                if self.scaler is None:
                    self.optimizer.step()
                else:
                    self.scaler.step(self.optimizer)
            if self.scaler is not None:
                self.scaler.update()
            applied = True
            self.rule.after_step(pos.step)
            self.last_loss = loss
            return True
        except PeerLost:
            if self.recovery is None:
                raise
            done = self.recovery.recover(self.survivors, pos, holding=True, applied=applied)
            if not done:
                self.guard.restore()
            if applied:
                self.last_loss = loss
            return done

    def tolerant(self, fn: Callable[..., Any], pos: Position, *args: Any) -> Any:
        """``fn(pos, *args)``, recovering from lost workers and calling it again (not within a step)."""
        while True:
            try:
                return fn(pos, *args)
            except PeerLost:
                if self.recovery is None:
                    raise
                self.recovery.recover(self.survivors, pos, holding=False, applied=True)

    def end_epoch(self, pos: Position, epochs: int, span: Any) -> nn.Module | None:
        """The epoch's records, after validation when due; the model validated (None: no validation)."""
        self.guard.check()
        self.validator.gather()
        self.rule.on_epoch_end(pos.epoch)
        reported = None
        every = self.cfg.val_every
        if every < 1 or (pos.epoch + 1) % int(every) == 0 or pos.epoch == epochs - 1:
            reported = self.validator.validate(pos.epoch, pos.step)
        mean_loss = float(span.loss) / max(1, span.steps)
        train_loss = self.workers.allreduce_values([mean_loss])[0] / self.workers.size
        rates, extra = span.rates(self.workers.size), self.rule.metrics()
        self.log.write("epoch", pos.step, epoch=pos.epoch, train_loss=train_loss, **rates, **extra)
        return reported

    def end(self, pos: Position, epochs: int, start: Position) -> None:
        """The end of training: the last agreement, the final checkpoint, the rule's last exchanges."""
        self.guard.check()
        self.control.close()
        self.validator.gather()  # a run stopped within an epoch
        if not self.preempted:
            self.save(Position(pos.step, max(epochs, start.epoch), 0), True)
        self.rule.finish()

    def forward(self, x: torch.Tensor, y: torch.Tensor, first: bool) -> torch.Tensor:
        """The loss of a micro-batch. On the first one, every rank checks that the outputs and targets fit
        the task, and a model that does not take the data fails with one line naming the shapes (rather
        than deep inside torch)."""
        try:
            with autocast(self.device, self.cfg.precision):
                out = self.model(x)
                if first:
                    self.task.check(out, y)
                return self.task.loss(out, y)
        except (RuntimeError, IndexError) as err:
            if not first or isinstance(err, torch.OutOfMemoryError):
                raise
            raise ValueError(
                f"{type(self.model).__name__} does not take this data: inputs {list(x.shape)}, targets "
                f"{list(y.shape)} {str(y.dtype).removeprefix('torch.')} failed with: "
                f"{str(err).splitlines()[0]}; check model.input_shape and model.num_classes against "
                "data.shape and data.num_classes, and task=classification|regression|language_model"
            ) from None

    def at_step_end(self, pos: Position) -> bool:
        """Checkpoint when due (every worker decides alike); True when the launcher asked to stop."""
        every = self.val_steps
        if every and pos.batch % every == 0 and pos.batch < len(self.train_loader) // self.cfg.accumulate:
            self.validator.validate(pos.epoch, pos.step)
            self.model.train()
        decision = self.control.poll(pos.step)
        if decision.validate:
            self.validator.by_time(pos)
        self.growth.note(decision)
        self.preempted = decision.stop
        if decision.stop or decision.checkpoint or self.control.checkpointer.due(pos.step):
            self.save(pos, False)
        return self.preempted

    def save(self, pos: Position, end: bool) -> None:
        """Checkpoint, unless the model is no longer finite: then the run has diverged, and the last good
        checkpoint is kept."""
        self.guard.check_model(pos.step)
        # the checkpoint is named by rank 0's step (dynamic assignment: each worker is at its own)
        step = pos.step if self.dealer is None else int(self.workers.broadcast_object(pos.step))
        self.rule.before_checkpoint(step)
        state = self.state.checkpoint(pos)
        self.log.flush()
        info = {
            "epoch": pos.epoch,
            "batch": pos.batch,
            "end": end,
            "metrics_lines": self.log.lines,
            "elapsed": self.log.elapsed(),
            "validation": self.validator.history[-1] if self.validator.history else None,
        }
        self.control.checkpointer.save(step, state, info)
        self.guard.checkpointed = step
        self.meter.echo(f"checkpoint after step {step} (epoch {pos.epoch}, batch {pos.batch})")

    def restore(self, part: dict[str, Any]) -> Position:
        """Take this rank's part of a checkpoint (as :meth:`save` wrote it); returns where training stood."""
        return self.state.restore(part)

    def resume_dealing(self, deal: dict[str, Any] | None, step: int) -> None:
        """Deal what the checkpoint's workers had not trained: its ``pending`` tickets, then from ``base``."""
        if deal is None:
            raise ValueError(
                f"the checkpoint after step {step} was written with data.assignment=static: resume it "
                "with data.assignment=static"
            )
        self.dealer.base, self.dealer.pending = deal["base"], list(deal["pending"])
        self.meetings_done, self.passed = deal["meetings"], deal["passed"]

    def close(self) -> None:
        """Stop the loaders' background processes (the worker then leaves without Python's teardown,
        which would stop them)."""
        for loader in (self.train_loader, *self.validator.loaders()):
            if getattr(loader, "_iterator", None) is not None:  # persistent loader processes
                loader._iterator = None  # the last reference: its __del__ shuts them down now
