"""The one training loop that serves every synchronization rule."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from runner.checkpoint import Control
from runner.comm import Comm, CommStats, PeerLost
from runner.config import TrainConfig
from runner.heartbeat import Heartbeat
from runner.meter import Meter
from runner.metrics import MetricsLog
from runner.rules.base import Rule

if TYPE_CHECKING:
    from runner.recovery import Recovery


def norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``tensors`` together: finite exactly when every element is (barring overflow)."""
    return torch.nn.utils.get_total_norm(tensors, foreach=True) if tensors else torch.zeros(())


def poisoned(loss: torch.Tensor, buffers: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """``scale · loss`` while the loss and the BatchNorm statistics its forward pass updated are finite, else
    NaN: backward then gives NaN gradients, so a rule that averages them carries one rank's non-finite step
    to every rank, and all of them decide alike (without a host sync). ``scale`` is the rule's
    :attr:`~runner.rules.base.Rule.loss_scale`, applied in the same multiplication at no cost."""
    ok = torch.isfinite(loss) & torch.isfinite(norm(buffers))
    return loss * torch.where(ok, scale, float("nan"))


def broadcast_state(model: nn.Module, comm: Comm, root: int = 0) -> None:
    """Give every rank ``root``'s parameters and buffers."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, root=root)


class Diverged(RuntimeError):
    """A non-finite loss or gradient with ``train.on_nonfinite=stop``: the job ends with status diverged."""


@dataclass
class Position:
    """Where training stands: ``step`` steps done, ``batch`` of them in epoch ``epoch``."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


class Trainer:
    """Trains ``model`` on this rank's shard (``train_loader``), handing control to ``rule`` at its hooks.

    ``workers`` is the communicator of the training ranks (for metrics), ``stats`` this rank's
    communication accounting (shared by all of its communicators). ``checkpoint(position, end)`` saves a
    checkpoint (collective over the job); ``control`` says, at the same step on every worker, when to take
    one or stop; ``beat`` is told of every step. ``delay_s`` (``simulate.straggler_ms`` on a straggler,
    else 0) is slept at the start of every step, before any of the step's work: a worker that much slower
    to compute, under every rule, and counted in the step's measured time.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loaders: tuple[DataLoader, DataLoader],
        rule: Rule,
        workers: Comm,
        stats: CommStats,
        device: torch.device,
        log: MetricsLog,
        meter: Meter,
        control: Control,
        checkpoint: Callable[[Position, bool], None],
        beat: Heartbeat,
        recovery: Recovery | None = None,
        delay_s: float = 0.0,
    ):
        self.cfg, self.model, self.optimizer, self.rule = cfg, model, optimizer, rule
        self.train_loader, self.val_loader = loaders
        self.workers, self.stats, self.device, self.log, self.meter = workers, stats, device, log, meter
        self.control, self.checkpoint, self.beat, self.recovery = control, checkpoint, beat, recovery
        self.delay_s = delay_s
        self.shard_plan: tuple[int, int] | None = None  # a resumed epoch's split of the data, if not ours
        self.criterion = nn.CrossEntropyLoss()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.kept: list[torch.Tensor] = []
        self.history: list[dict[str, float]] = []
        self.skipped = 0
        self.preempted = False
        self.first_step, self.last_loss = 0, float("nan")

    def fit(self, max_steps: int, epochs: int, start: Position) -> tuple[nn.Module, dict[str, Any]]:
        """Train from ``start``; returns the model the run reports (the rule's first evaluated model) and the
        results. Stops early, after a checkpoint, when the launcher asks (``self.preempted``)."""
        pos, reported = Position(start.step, start.epoch, start.batch), self.model
        sampler, self.first_step = self.train_loader.sampler, start.step
        for epoch in range(start.epoch, epochs):
            pos.epoch = epoch
            plan = self.shard_plan if epoch == start.epoch and self.shard_plan else None
            sampler.reshard(*(plan or (self.workers.rank, self.workers.size)))
            if self.recovery is not None and self.cfg.max_steps is None:  # survivors: longer epochs
                max_steps = pos.step - pos.batch + (epochs - epoch) * len(self.train_loader)
            sampler.set_epoch(epoch)
            sampler.start_at(pos.batch * self.cfg.batch_size)
            self.model.train()
            for x, y in self.meter.batches(self.train_loader):
                if pos.step >= max_steps:
                    break
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                while not self.step(x, y, pos):
                    pass
                pos.step, pos.batch = pos.step + 1, pos.batch + 1
                self.beat.progress(pos.step)
                self.meter.step_done(
                    pos.step, epoch, self.last_loss, len(x), self.optimizer.param_groups[0]["lr"]
                )
                if self.tolerant(self.at_step_end, pos) or pos.step >= max_steps:
                    break
            if self.preempted:
                self.meter.epoch_done()
                break
            span = self.meter.epoch_done()
            reported = self.tolerant(self.end_epoch, pos, epochs, span) or reported
            pos.batch = 0
        self.meter.close()
        self.tolerant(self.end, pos, epochs, start)
        return reported, self._summary(epochs, pos.step)

    def step(self, x: torch.Tensor, y: torch.Tensor, pos: Position) -> bool:
        """One training step on a batch; False when it must be redone (workers were lost during it)."""
        applied = False
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            self.rule.before_step(pos.step)
            self.optimizer.zero_grad(set_to_none=False)
            self.keep_buffers()
            loss = self.forward(x, y, first=pos.step == self.first_step)
            poisoned(loss, self.buffers, self.rule.loss_scale).backward()
            self.rule.after_backward(pos.step)
            if self.finite(loss, pos.step):
                self.optimizer.step()
            applied = True
            self.rule.after_step(pos.step)
            self.last_loss = loss.item()
            return True
        except PeerLost:
            if self.recovery is None:
                raise
            done = self.recovery.recover(self, pos, holding=True, applied=applied)
            if not done:
                self.restore_buffers()
            if applied:
                self.last_loss = loss.item()
            return done

    def tolerant(self, fn: Callable[..., Any], pos: Position, *args: Any) -> Any:
        """``fn(pos, *args)``, recovering from lost workers and calling it again (not within a step)."""
        while True:
            try:
                return fn(pos, *args)
            except PeerLost:
                if self.recovery is None:
                    raise
                self.recovery.recover(self, pos, holding=False, applied=True)

    def end_epoch(self, pos: Position, epochs: int, span: Any) -> nn.Module | None:
        """The epoch's records, after validation when due; the model validated (None: no validation)."""
        self.rule.on_epoch_end(pos.epoch)
        reported = None
        if (pos.epoch + 1) % self.cfg.val_every == 0 or pos.epoch == epochs - 1:
            reported = self.validate(pos.epoch, pos.step)
        mean_loss = span.loss / max(1, span.steps)
        train_loss = self.workers.allreduce_values([mean_loss])[0] / self.workers.size
        rates, extra = span.rates(self.workers.size), self.rule.metrics()
        self.log.write("epoch", pos.step, epoch=pos.epoch, train_loss=train_loss, **rates, **extra)
        return reported

    def end(self, pos: Position, epochs: int, start: Position) -> None:
        """The end of training: the last agreement, the final checkpoint, the rule's last exchanges."""
        self.control.close()
        if not self.preempted:
            self.save(Position(pos.step, max(epochs, start.epoch), 0), True)
        self.rule.finish()

    def forward(self, x: torch.Tensor, y: torch.Tensor, first: bool) -> torch.Tensor:
        """The loss of a batch. A model that does not take the data fails on the first batch with one line
        naming the shapes (rather than deep inside torch)."""
        try:
            return self.criterion(self.model(x), y)
        except (RuntimeError, IndexError) as err:
            if not first:
                raise
            raise ValueError(
                f"{type(self.model).__name__} does not take this data: inputs {list(x.shape)}, labels "
                f"{list(y.shape)} up to {int(y.max())} failed with: {str(err).splitlines()[0]}; check "
                "model.input_shape and model.num_classes against data.shape and data.num_classes"
            ) from None

    def at_step_end(self, pos: Position) -> bool:
        """Checkpoint when due (every worker decides alike); True when the launcher asked to stop."""
        decision = self.control.poll(pos.step)
        self.preempted = decision.stop
        if decision.stop or decision.checkpoint or self.control.checkpointer.due(pos.step):
            self.save(pos, False)
        return self.preempted

    def save(self, pos: Position, end: bool) -> None:
        """Checkpoint, unless the model is no longer finite (a finite gradient times a large learning rate
        can overflow a parameter, large activations a BatchNorm statistic): then the run has diverged, and
        the last good checkpoint is kept."""
        state = self.model.state_dict()
        tensors = [t for t in state.values() if t.is_floating_point()]
        if not bool(torch.isfinite(norm(tensors))):
            bad = next(k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all())
            raise Diverged(
                f"non-finite {bad} after step {pos.step} on rank {self.workers.rank}; lower optim.lr; "
                "the last good checkpoint is kept"
            )
        self.checkpoint(pos, end)

    def finite(self, loss: torch.Tensor, step: int) -> bool:
        """Whether the step may be applied: loss, BatchNorm statistics and gradients finite. Otherwise
        ``on_nonfinite=stop`` raises :class:`Diverged`; ``skip`` drops the step (its update and its
        BatchNorm statistics) and counts it. Rules that exchange gradients (BSP) decide alike on every rank,
        since a rank's non-finite step poisons the gradient it sends. A rule that holds every gradient in a
        few flat buffers (BSP's buckets) has their sums checked, a third cheaper than the norm and as sure:
        a NaN or infinity anywhere makes the sum non-finite."""
        flat = self.rule.grad_buffers()
        if flat:
            grad_norm = torch.stack([b.sum() for b in flat]).sum()
        else:
            grad_norm = norm([p.grad for p in self.params if p.grad is not None])
        if bool(torch.isfinite(grad_norm)):
            return True
        if not bool(torch.isfinite(loss)):
            what = f"loss {loss.item()}"
        elif not bool(torch.isfinite(norm(self.buffers))):
            what = "BatchNorm statistics"
        else:
            what = f"gradient ({'sum' if flat else 'norm'} {grad_norm.item()})"
        if self.cfg.on_nonfinite == "stop":
            raise Diverged(
                f"non-finite {what} at step {step + 1} on rank {self.workers.rank}; lower optim.lr, or "
                "train.on_nonfinite=skip to drop such steps; the last good checkpoint is kept"
            )
        self.skipped += 1
        self.optimizer.zero_grad(set_to_none=False)
        self.restore_buffers()
        if self.skipped <= 3 or self.skipped % 100 == 0:
            self.meter.echo(f"step {step + 1}: non-finite {what}, step skipped ({self.skipped} so far)")
        return False

    def keep_buffers(self) -> None:
        """With ``on_nonfinite=skip`` or fault tolerance, copy the BatchNorm statistics before the forward
        pass updates them, so that a dropped or redone step leaves no trace in them either."""
        if (self.cfg.on_nonfinite == "skip" or self.recovery is not None) and self.buffers:
            if not self.kept:
                self.kept = [b.clone() for b in self.buffers]
            with torch.no_grad():
                for kept, buffer in zip(self.kept, self.buffers, strict=True):
                    kept.copy_(buffer)

    @torch.no_grad()
    def restore_buffers(self) -> None:
        for buffer, kept in zip(self.buffers, self.kept, strict=True):
            buffer.copy_(kept)

    def state_dict(self) -> dict[str, Any]:
        sampler = self.train_loader.sampler
        return {
            "history": self.history,
            "skipped": self.skipped,
            "meter": self.meter.state_dict(),
            "shard": [sampler.rank, sampler.num_replicas],
        }

    def load_state_dict(self, state: dict[str, Any], step: int, mid_epoch: bool) -> None:
        self.history, self.skipped = list(state["history"]), state["skipped"]
        self.meter.load_state_dict(state["meter"], step, mid_epoch)
        if mid_epoch and "shard" in state:
            self.shard_plan = tuple(state["shard"])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """Validation loss and accuracy of ``model`` over the whole validation set (all ranks' shares)."""
        was_training = model.training
        model.eval()
        loss_sum = correct = count = 0.0
        for x, y in self.val_loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            out = model(x)
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            count += len(y)
        model.train(was_training)
        loss_sum, correct, count = self.workers.allreduce_values([loss_sum, correct, count])
        return loss_sum / count, correct / count

    def validate(self, epoch: int, step: int) -> nn.Module:
        """Evaluate the rule's models, record them, and return the one the run reports."""
        record: dict[str, float] = {}
        models = self.rule.eval_models()
        for name, model in models.items():
            prefix = f"{name}_" if name else ""
            record[f"{prefix}val_loss"], record[f"{prefix}val_acc"] = self.evaluate(model)
        self.history.append(record)
        self.log.write("val", step, epoch=epoch, **record)
        self.meter.echo(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in record.items()))
        return next(iter(models.values()))

    def _summary(self, epochs: int, steps: int) -> dict[str, Any]:
        """The run's results (validation results None when it was preempted before its first)."""
        rates = self.meter.total.rates(self.workers.size)
        vals: dict[str, Any] = dict.fromkeys(
            ("final_val_acc", "final_val_loss", "best_val_acc", "best_val_loss")
        )
        if self.history:
            key = next(k for k in self.history[-1] if k.endswith("val_acc"))
            loss_key = key.replace("val_acc", "val_loss")
            vals.update(
                final_val_acc=self.history[-1][key],
                final_val_loss=self.history[-1][loss_key],
                best_val_acc=max(r[key] for r in self.history),
                best_val_loss=min(r[loss_key] for r in self.history),
            )
        return {
            "epochs": epochs,
            "steps": steps,
            **vals,
            "samples_per_s": rates["samples_per_s"],
            "comm_fraction": rates["comm_frac"],
            "data_wait_fraction": rates["data_frac"],
            "compute_fraction": rates["compute_frac"],
            "bytes_sent": self.workers.allreduce_values([self.stats.bytes_sent])[0],
            "skipped_steps": self.skipped,
            "validations": self.history,
        }
