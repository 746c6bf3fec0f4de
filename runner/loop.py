"""The one training loop that serves every synchronization rule."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from runner.comm import Comm, CommStats
from runner.config import TrainConfig
from runner.meter import Meter
from runner.metrics import MetricsLog
from runner.rules.base import Rule


def broadcast_state(model: nn.Module, comm: Comm, root: int = 0) -> None:
    """Give every rank ``root``'s parameters and buffers."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, root=root)


class Trainer:
    """Trains ``model`` on this rank's shard (``train_loader``), handing control to ``rule`` at its hooks.

    ``workers`` is the communicator of the training ranks (for metrics), ``stats`` this rank's
    communication accounting (shared by all of its communicators).
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
    ):
        self.cfg, self.model, self.optimizer, self.rule = cfg, model, optimizer, rule
        self.train_loader, self.val_loader = loaders
        self.workers, self.stats, self.device, self.log, self.meter = workers, stats, device, log, meter
        self.criterion = nn.CrossEntropyLoss()
        self.history: list[dict[str, float]] = []

    def fit(self, max_steps: int, epochs: int) -> tuple[nn.Module, dict[str, Any]]:
        """Train; returns the model the run reports (the rule's first evaluated model) and the results."""
        step, reported = 0, self.model
        for epoch in range(epochs):
            self.train_loader.sampler.set_epoch(epoch)
            self.model.train()
            for x, y in self.meter.batches(self.train_loader):
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                self.rule.before_step(step)
                self.optimizer.zero_grad(set_to_none=False)
                loss = self.criterion(self.model(x), y)
                loss.backward()
                self.rule.after_backward(step)
                self.optimizer.step()
                self.rule.after_step(step)
                step += 1
                self.meter.step_done(step, epoch, loss.item(), len(x), self.optimizer.param_groups[0]["lr"])
                if step >= max_steps:
                    break
            self.rule.on_epoch_end(epoch)
            span = self.meter.epoch_done()
            if (epoch + 1) % self.cfg.val_every == 0 or epoch == epochs - 1:
                reported = self.validate(epoch, step)
            mean_loss = span.loss / max(1, span.steps)
            train_loss = self.workers.allreduce_values([mean_loss])[0] / self.workers.size
            rates, extra = span.rates(self.workers.size), self.rule.metrics()
            self.log.write("epoch", step, epoch=epoch, train_loss=train_loss, **rates, **extra)
        self.meter.close()
        self.rule.finish()
        return reported, self._summary(epochs, step)

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
        rates = self.meter.total.rates(self.workers.size)
        key = next(k for k in self.history[-1] if k.endswith("val_acc"))
        loss_key = key.replace("val_acc", "val_loss")
        best = max(self.history, key=lambda r: r[key])
        return {
            "epochs": epochs,
            "steps": steps,
            "final_val_acc": self.history[-1][key],
            "final_val_loss": self.history[-1][loss_key],
            "best_val_acc": best[key],
            "best_val_loss": min(r[loss_key] for r in self.history),
            "samples_per_s": rates["samples_per_s"],
            "comm_fraction": rates["comm_frac"],
            "data_wait_fraction": rates["data_frac"],
            "compute_fraction": rates["compute_frac"],
            "bytes_sent": self.workers.allreduce_values([self.stats.bytes_sent])[0],
            "validations": self.history,
        }
