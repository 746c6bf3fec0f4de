"""The one training loop that serves every synchronization rule."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch import nn
from tqdm import tqdm

from data.base import ClassificationData
from runner.comm import Comm
from runner.metrics import MetricsLog
from runner.rules.base import Rule


def broadcast_state(model: nn.Module, comm: Comm, root: int = 0) -> None:
    """Give every rank ``root``'s parameters and buffers."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, root=root)


@dataclass
class Timing:
    """Seconds of a span of steps, split into data wait, compute and (exposed) communication."""

    data: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    samples: int = 0
    steps: int = 0

    @property
    def total(self) -> float:
        return self.data + self.compute + self.comm

    def add(self, other: Timing) -> None:
        self.data += other.data
        self.compute += other.compute
        self.comm += other.comm
        self.samples += other.samples
        self.steps += other.steps


class Trainer:
    """Trains ``model`` on this rank's shard of ``data``, handing control to ``rule`` at its hooks.

    Per step: wait for a batch (data), forward/backward/optimizer step (compute), and whatever the rule
    spends inside the communication layer (comm, measured there, so overlapped communication that does
    not hold the step up is not counted).
    """

    def __init__(
        self,
        train_cfg: Any,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: ClassificationData,
        rule: Rule,
        device: torch.device,
        log: MetricsLog,
        terminal: TextIO | None = None,
        log_file: TextIO | None = None,
    ):
        self.cfg, self.model, self.optimizer, self.data = train_cfg, model, optimizer, data
        self.rule, self.device, self.log = rule, device, log
        self.workers: Comm = rule.workers
        self.terminal, self.log_file = terminal, log_file
        self.criterion = nn.CrossEntropyLoss()
        self.history: list[dict[str, float]] = []
        self.total = Timing()

    def _comm_seconds(self) -> float:
        return self.rule.comm.seconds

    def fit(self) -> dict[str, Any]:
        cfg, workers = self.cfg, self.workers
        rank, world = workers.rank, workers.size
        pin = self.device.type == "cuda"
        loader = self.data.train_loader(rank, world, cfg.batch_size, cfg.seed, pin_memory=pin)
        val_loader = self.data.val_loader(rank, world, cfg.val_batch_size, pin_memory=pin)
        steps_per_epoch = len(loader)
        self.rule.setup(self.model, self.optimizer, steps_per_epoch)
        max_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
        epochs = min(cfg.epochs, -(-max_steps // steps_per_epoch))
        step, start = 0, time.perf_counter()
        self.bar = bar = tqdm(
            total=max_steps,
            file=self.terminal,
            disable=self.terminal is None or not cfg.progress,
            dynamic_ncols=True,
            mininterval=0.5,
            leave=True,
        )
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            self.model.train()
            span, loss_sum, window_loss, window = Timing(), 0.0, 0.0, Timing()
            t_ready = time.perf_counter()
            for x, y in loader:
                t_data = time.perf_counter()
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                comm0 = self._comm_seconds()
                self.rule.before_step(step)
                self.optimizer.zero_grad(set_to_none=False)
                loss = self.criterion(self.model(x), y)
                loss.backward()
                self.rule.after_backward(step)
                self.optimizer.step()
                self.rule.after_step(step)
                loss_value = loss.item()
                t_done = time.perf_counter()
                comm = self._comm_seconds() - comm0
                t = Timing(
                    data=t_data - t_ready, compute=t_done - t_data - comm, comm=comm, samples=len(x), steps=1
                )
                span.add(t)
                window.add(t)
                loss_sum += loss_value
                window_loss += loss_value
                step += 1
                if step % cfg.log_every == 0:
                    self.log.write(
                        "step",
                        step,
                        epoch=epoch,
                        loss=window_loss / window.steps,
                        lr=self.optimizer.param_groups[0]["lr"],
                        **self._rates(window, world),
                    )
                    window_loss, window = 0.0, Timing()
                bar.update(1)
                bar.set_postfix(
                    epoch=epoch,
                    loss=f"{loss_value:.4f}",
                    samples_s=f"{span.samples * world / max(span.total, 1e-9):.0f}",
                    refresh=False,
                )
                t_ready = time.perf_counter()
                if step >= max_steps:
                    break
            self.rule.on_epoch_end(epoch)
            self.total.add(span)
            if (epoch + 1) % cfg.val_every == 0 or epoch == epochs - 1:
                self.validate(val_loader, epoch, step)
            loss_mean = workers.allreduce_values([loss_sum / max(1, span.steps)])[0] / world
            self.log.write(
                "epoch",
                step,
                epoch=epoch,
                train_loss=loss_mean,
                **self._rates(span, world),
                **self.rule.metrics(),
            )
        bar.close()
        self.rule.finish()
        wall = time.perf_counter() - start
        return self._summary(wall, epochs, step)

    def echo(self, text: str) -> None:
        """A line for this rank's log and, on rank 0, for the terminal (above the progress bar)."""
        if self.log_file is not None:
            self.log_file.write(text + "\n")
        if self.terminal is not None:
            if self.bar.disable:
                self.terminal.write(text + "\n")
            else:
                self.bar.write(text, file=self.terminal)

    def _rates(self, t: Timing, world: int) -> dict[str, float]:
        """Throughput and the step-time split of span ``t`` on this rank (samples/s counts all workers)."""
        total = max(t.total, 1e-12)
        return {
            "samples_per_s": t.samples * world / total,
            "compute_frac": t.compute / total,
            "comm_frac": t.comm / total,
            "data_frac": t.data / total,
            "step_ms": 1e3 * total / max(1, t.steps),
        }

    @torch.no_grad()
    def evaluate(self, model: nn.Module, val_loader: torch.utils.data.DataLoader) -> tuple[float, float]:
        """Validation loss and accuracy of ``model`` over the whole validation set (all ranks' shares)."""
        was_training = model.training
        model.eval()
        loss_sum = correct = count = 0.0
        for x, y in val_loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            out = model(x)
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            count += len(y)
        model.train(was_training)
        loss_sum, correct, count = self.workers.allreduce_values([loss_sum, correct, count])
        return loss_sum / count, correct / count

    def validate(self, val_loader: torch.utils.data.DataLoader, epoch: int, step: int) -> None:
        record: dict[str, float] = {}
        models = self.rule.eval_models()
        self.reported_model = next(iter(models.values()))
        for name, model in models.items():
            prefix = f"{name}_" if name else ""
            record[f"{prefix}val_loss"], record[f"{prefix}val_acc"] = self.evaluate(model, val_loader)
        self.history.append(record)
        self.log.write("val", step, epoch=epoch, **record)
        self.echo(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in record.items()))

    def _summary(self, wall: float, epochs: int, steps: int) -> dict[str, Any]:
        world = self.workers.size
        rates = self._rates(self.total, world)
        key = next(k for k in self.history[-1] if k.endswith("val_acc"))
        loss_key = key.replace("val_acc", "val_loss")
        best = max(self.history, key=lambda r: r[key])
        return {
            "epochs": epochs,
            "steps": steps,
            "wall_time_s": wall,
            "final_val_acc": self.history[-1][key],
            "final_val_loss": self.history[-1][loss_key],
            "best_val_acc": best[key],
            "best_val_loss": min(r[loss_key] for r in self.history),
            "samples_per_s": rates["samples_per_s"],
            "comm_fraction": rates["comm_frac"],
            "data_wait_fraction": rates["data_frac"],
            "compute_fraction": rates["compute_frac"],
            "bytes_sent": self.workers.allreduce_values([self.rule.comm.bytes_sent])[0],
            "validations": self.history,
        }
