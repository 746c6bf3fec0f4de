"""The one training loop that serves every synchronization rule."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from runner.comm import PeerLost
from runner.rank.agreement import Control, Decision, settle
from runner.rank.assignment import Dealer
from runner.rank.guard import Diverged, Guard, fell_to_chance
from runner.rank.pace import Dynamic, Given, Pace, Static
from runner.rank.prefetch import Batch, Prefetch
from runner.rank.records.heartbeat import Heartbeat
from runner.rank.records.meter import Meter
from runner.rank.records.metrics import MetricsLog
from runner.rank.records.summary import Outcome, summary
from runner.rank.resilience.crew import Crew
from runner.rank.resilience.growth import Growth
from runner.rank.resilience.survivor import Survivors
from runner.rank.state import Position
from runner.rank.trainer_state import Owners, TrainerState
from runner.rank.validation import autocast
from runner.rank.validator import Validator
from runner.results import no_improvement
from runner.rules.base import Rule
from runner.schema.sections import TrainConfig
from runner.tasks import Task

if TYPE_CHECKING:
    from runner.comm.face import CommLike
    from runner.rank.resilience.recovery import Recovery
    from runner.schedule import Schedule


def grouped(batches: Iterable[Batch], k: int) -> Iterator[list[Batch]]:
    """Consecutive groups of ``k`` batches (the micro-batches of one accumulated step).

    An incomplete last group is dropped."""
    group: list[Batch] = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []


@dataclass
class Parts:
    """What is trained, and how.

    The model, its optimizer, the synchronization rule, the task (loss and metrics) and the learning-rate
    schedule."""

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
    """Where a worker trains: its communicator with the other workers, its device, and a straggler's delay.

    ``workers.stats`` accounts its communication; ``delay_s`` is slept (or with ``spin``, spent spinning) at
    the start of every step (a simulated straggler)."""

    workers: CommLike
    device: torch.device
    delay_s: float = 0.0
    spin: bool = False


@dataclass
class Records:
    """What the loop reports to and agrees through.

    ``metrics.jsonl``, the meter (timing and progress), the heartbeat, the workers' agreement on checkpoints
    and stops (``control``, with its checkpointer), and the validation metric the run reports
    (``monitor``: early stopping watches it)."""

    log: MetricsLog
    meter: Meter
    beat: Heartbeat
    control: Control
    monitor: str = "val_acc"


class Trainer:
    """Trains ``parts.model`` on this rank's shard, handing control to the rule at its hooks.

    The shard's loaders are ``loaders`` (train and validation). A step is ``cfg.accumulate`` loader batches
    (micro-batches): their gradients are summed, each loss divided by their number, and the rule exchanges
    once per step (BSP: its buckets are all-reduced during the last micro-batch's backward). The schedule
    sets the learning rate before every optimizer step. With ``cfg.precision`` bf16 or fp16 the forward
    passes run under autocast; fp16 scales the loss with a gradient scaler (a step whose gradients overflow
    is skipped and the scale halved). ``records.control`` says, at the same step on every worker, when to
    checkpoint or stop.

    The loop holds its components: the pace of its steps, chosen once (:mod:`runner.rank.pace`: static
    shards or dynamic assignment), the validator (:class:`~runner.rank.validator.Validator`) and the
    training state's three uses (:class:`~runner.rank.trainer_state.TrainerState`), each given the parts
    it uses (never the loop). With ``recovery`` (fault tolerance) a lost worker is survived:
    recovery works through the loop's :class:`Survivors <runner.rank.resilience.survivor.Survivors>`, and
    the job grows through its :class:`Growth <runner.rank.resilience.growth.Growth>`.

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
        keep = cfg.on_nonfinite == "skip" or recovery is not None  # a step may be dropped or redone
        fp16 = self.scaler is not None
        rank = lambda: self.workers.rank  # noqa: E731 (recovery gives the survivors new ranks)
        self.guard = Guard(
            self.model, self.optimizer, self.rule, cfg.on_nonfinite, keep, fp16, self.meter.echo, rank
        )
        self.preempted = False
        self.cut: Position | None = None  # where train.max_steps ended the run within an epoch
        self.first_step = 0
        self.last_loss: float | torch.Tensor = float("nan")  # the last step's, left on the device (detached)
        self.prefetch = Prefetch(self.device)
        # dynamic assignment (data.assignment): the dealer of this worker's chunks; the pace, chosen once
        sampler = getattr(self.train_loader, "batch_sampler", None)
        self.dealer: Dealer | None = sampler if isinstance(sampler, Dealer) else None
        kept = (self.log, self.meter, self.guard)
        trained = (self.model, self.rule, self.task)
        self.validator = Validator(cfg, trained, self.workers, self.device, kept, val_loader, self.dealer)
        given = Given(
            cfg, self.train_loader, self.workers, self.model, self.schedule, self.meter, self.validator,
            self.control, self.decide, self.tolerant, self.grow_if_due,
        )  # fmt: skip
        dynamic = self.dealer is not None
        self.pace: Pace = Dynamic(given, self.dealer) if dynamic else Static(given, recovery is not None)
        by_claim = self.validator.alone  # the free worker claims a validation by time
        timed = self.cfg.val_every_s is not None and not by_claim
        if self.control is not None:
            self.control.validation_due = self.validator.due_by_time if timed else None
        owners = Owners(
            self.model, self.optimizer, self.rule, self.scaler, self.validator, self.guard, self.meter,
            self.control and self.control.checkpointer, self.schedule, self.pace,
        )  # fmt: skip
        self.state = TrainerState(owners)  # its three uses: checkpoint, a joining worker's package, a share
        crew = Crew(
            self.workers, self.rule, self.state, self.pace, self.validator, self.control, self.meter, self.log
        )
        self.growth = Growth(recovery, crew, self.model, self.tolerant)  # the job grows (heal, RUN_DIR/JOIN)
        self.survivors = Survivors(crew, self.save, self.growth)  # what recovery asks (fault tolerance)

    def fit(self, max_steps: int, epochs: int, start: Position) -> tuple[nn.Module, dict[str, Any]]:
        """Train from ``start``; returns the model the run reports and the results.

        The model reported is the rule's first evaluated model. Stops early, after a checkpoint, when the
        launcher asks (``self.preempted``)."""
        pos, reported, v = Position(start.step, start.epoch, start.batch), self.model, self.validator
        self.first_step, pace = start.step, self.pace
        for epoch in range(start.epoch, epochs):
            pos.epoch = epoch
            self.growth.if_due(pos, mid_epoch=False)
            max_steps = pace.begin_epoch(pos, epochs, start, max_steps)
            self.model.train()
            self.train_span(pos, epoch, max_steps)
            while pace.end_of_span(pos):  # dynamic assignment: chunks dealt anew (a lost worker's)
                self.train_span(pos, epoch, max_steps)
            if self.preempted:
                self.meter.epoch_done()
                break
            done = pace.cut_at(pos, max_steps)  # (its final checkpoint is here: a longer resume goes on)
            span = self.meter.epoch_done()
            reported = self.tolerant(self.end_epoch, pos, epochs, span, done) or reported
            pace.end_of_epoch(epoch)
            if done is not None:
                self.cut = Position(pos.step, pos.epoch, pos.batch)
            pos.batch = 0
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
        return reported, self.tolerant(self.results, pos, epochs)

    def results(self, pos: Position, epochs: int) -> dict[str, Any]:
        """Collective over the workers: the rule's last exchanges (``Rule.finish``), then the results.

        Called by :meth:`tolerant`, so both are done again after a recovery: they come after the last
        checkpoint's job-wide barrier, which goes on without a lost worker, while the workers' communicator
        still holds it."""
        v, fp16 = self.validator, self.scaler is not None
        control, dealer = self.control, self.dealer
        spent = {"agreement": control.seconds, "heartbeat": self.beat.seconds}
        if dealer is not None:
            spent["deal"] = dealer.seconds
        outcome = Outcome(
            v.history, v.reported_prefix, self.monitor, self.stopped_early, fp16, v.val_count, v.val_bytes,
            spent, control.checkpointer.seconds,
        )  # fmt: skip
        self.rule.finish()  # (not in end(): a loss in it may fail a probe on one survivor only)
        results = summary(outcome, epochs, pos.step, self.meter, self.guard, self.workers)
        settle(self.workers)  # (fault tolerance) all go on to the job-wide barrier after training, or none
        return results

    def train_span(self, pos: Position, epoch: int, max_steps: int) -> None:
        """Train the epoch's batches from the loader, up to ``max_steps``, a stop or a step that ends the run.

        Under dynamic assignment it trains until this worker's draws are spent; a step that ends the run
        stops it under static shards. Static shards: a batch the position has passed is not trained (a
        recovery gave this worker the state and position of a survivor that had trained on,
        ``Recovery._agree``)."""
        pace = self.pace
        groups = self.prefetch(grouped(self.train_loader, self.cfg.accumulate), ahead=pace.ahead)
        drawn = pos.batch  # static shards: the epoch's batches drawn (the loader starts at pos.batch)
        for micro in self.meter.batches(groups):
            drawn += 1
            if drawn <= pos.batch and self.dealer is None:
                continue  # its step was taken on the survivor whose state this worker took
            if pos.step >= max_steps or pace.before_step(pos):
                return
            self.growth.if_due(pos, mid_epoch=True)
            pace.start_step()
            while not self.step(micro, pos):
                pass
            pos.step, pos.batch = pos.step + 1, pos.batch + 1
            shown = pace.after_step()
            self.beat.progress(pos.step)
            if pos.step % self.cfg.log_every == 0:  # deferred non-finite checks: read before the record
                self.guard.check()
            samples = sum(len(x) for x, _ in micro)
            lr = self.optimizer.param_groups[0]["lr"]
            self.meter.step_done(pos.step, epoch, self.last_loss, samples, lr, shown)
            if pace.at_step_end(pos, max_steps):
                return

    def step(self, micro: list[Batch], pos: Position) -> bool:
        """One training step on its micro-batches; False when it must be redone.

        It must be redone when workers were lost during it."""
        applied = False
        if self.delay_s:
            delay(self.delay_s, self.spin)
        try:
            self.rule.before_step(pos.step)
            self.schedule.apply(self.pace.schedule_step(pos))
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

    def grow_if_due(self, pos: Position) -> None:
        """Grow the job within the epoch if the workers agreed to (the pace's ``grow``)."""
        self.growth.if_due(pos, mid_epoch=True)

    def decide(self, pos: Position, decision: Decision, due: bool) -> bool:
        """At an agreement: validate by time, note a growth, checkpoint when asked or ``due``.

        Every worker decides alike. True when the workers agreed to stop."""
        if decision.passed:
            return self.preempted
        if decision.validate:
            self.validator.by_time(pos, decision.validate)
        self.growth.note(decision)
        if decision.stop or decision.checkpoint or due:
            self.preempted = decision.stop
            self.save(pos, False)
        return self.preempted

    def tolerant(self, fn: Callable[..., Any], pos: Position, *args: Any) -> Any:
        """``fn(pos, *args)``, recovering from lost workers and calling it again (not within a step)."""
        while True:
            try:
                return fn(pos, *args)
            except PeerLost:
                if self.recovery is None:
                    raise
                self.recovery.recover(self.survivors, pos, holding=False, applied=True)

    def end_epoch(self, pos: Position, epochs: int, span: Any, done: float | None = None) -> nn.Module | None:
        """The epoch's records, after validation when due; the model validated (None: no validation).

        ``done``: the part of the epoch trained, where ``train.max_steps`` ended the run within it."""
        self.guard.check()
        self.validator.gather()
        self.rule.on_epoch_end(pos.epoch)
        reported = None
        every = self.cfg.val_every
        if every < 1 or (pos.epoch + 1) % int(every) == 0 or pos.epoch == epochs - 1:
            reported = self.validator.validate(pos.epoch, pos.step, done=done)
        mean_loss = float(span.loss) / max(1, span.steps)
        loss_sum, new = self.workers.allreduce_values([mean_loss, self.meter.new_samples()])
        train_loss = loss_sum / self.workers.size
        per_sample, samples = self.meter.tokens_per_sample, self.meter.job_samples + new
        rates, extra = span.rates(self.workers.size, per_sample), self.rule.metrics()
        if per_sample:  # tokens trained on so far, all workers' (unequal: dynamic assignment; lost, joined)
            rates["tokens"] = samples * per_sample
        settle(self.workers)  # (fault tolerance) all go on to the next epoch, or all do this one's again
        self.meter.count_job(new)  # (agreed: a retry of the epoch's end counts alike on every worker)
        self.log.write("epoch", pos.step, epoch=pos.epoch, train_loss=train_loss, **rates, **extra)
        return reported

    def end(self, pos: Position, epochs: int, start: Position) -> None:
        """The end of training: the last agreement and the final checkpoint."""
        self.guard.check()
        self.control.close()
        self.validator.gather()  # a run stopped within an epoch
        if not self.preempted:
            if self.cut is not None:
                self.meter.forget_epoch()
            self.save(self.cut or Position(pos.step, max(epochs, start.epoch), 0), True)
        settle(self.workers)  # (fault tolerance) all go on to the rule's last messages and results, or none

    def forward(self, x: torch.Tensor, y: torch.Tensor, first: bool) -> torch.Tensor:
        """The loss of a micro-batch.

        On the first one, every rank checks that the outputs and targets fit the task, and a model that does
        not take the data fails with one line naming the shapes (rather than deep inside torch)."""
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

    def save(self, pos: Position, end: bool) -> None:
        """Checkpoint, unless the model is no longer finite.

        Then the run has diverged, and the last good checkpoint is kept."""
        self.guard.check_model(pos.step)
        step = self.pace.checkpoint_step(pos)
        servers = self.rule.num_servers > 0  # they are asked once all workers took their part
        if not servers:
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
        # (fault tolerance) every worker took its part, or none goes on to the job-wide barrier, where one
        # would wait for another recovering; the servers are asked once, for the step finally agreed on
        settle(self.workers)
        if servers:
            self.rule.before_checkpoint(step)
        self.control.checkpointer.save(step, state, info)
        if self.recovery is not None:  # its job-wide barrier goes on without a lost server, unnamed
            self.recovery.check_servers(step)
        settle(self.workers)  # a worker lost in its job-wide part: all take the checkpoint again, or go on
        self.guard.checkpointed = step
        self.meter.echo(self.pace.checkpoint_words(step, pos))

    def restore(self, part: dict[str, Any]) -> Position:
        """Take this rank's part of a checkpoint (as :meth:`save` wrote it); returns where training stood."""
        return self.state.restore(part)

    def close(self) -> None:
        """Stop the loaders' background processes.

        The worker then leaves without Python's teardown, which would stop them."""
        for loader in (self.train_loader, *self.validator.loaders()):
            if getattr(loader, "_iterator", None) is not None:  # persistent loader processes
                loader._iterator = None  # the last reference: its __del__ shuts them down now
