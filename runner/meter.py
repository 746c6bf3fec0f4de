"""Step accounting for the training loop: timing, the logging window, the progress bar and echoed lines.

A step's time is split into data wait (until the batch arrived), exposed communication (seconds the rule
spent inside the communication layer during the step, so overlapped communication that does not hold the
step up is not counted) and compute (the rest).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from tqdm import tqdm

from runner.comm import CommStats
from runner.metrics import MetricsLog


@dataclass
class Timing:
    """Seconds of a span of steps, split into data wait, compute and (exposed) communication."""

    data: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    samples: int = 0
    steps: int = 0
    loss: float = 0.0

    @property
    def total(self) -> float:
        return self.data + self.compute + self.comm

    def add(self, other: Timing) -> None:
        self.data += other.data
        self.compute += other.compute
        self.comm += other.comm
        self.samples += other.samples
        self.steps += other.steps
        self.loss += other.loss

    def rates(self, world: int) -> dict[str, float]:
        """Throughput (samples/s of all ``world`` workers) and the split of the step time."""
        total = max(self.total, 1e-12)
        return {
            "samples_per_s": self.samples * world / total,
            "compute_frac": self.compute / total,
            "comm_frac": self.comm / total,
            "data_frac": self.data / total,
            "step_ms": 1e3 * total / max(1, self.steps),
        }


class Meter:
    """Times the steps of a run, writes a ``step`` record every ``log_every`` steps, and draws rank 0's bar.

    ``batches(loader)`` yields the loader's batches and starts each step's clock; ``step_done`` closes it.
    """

    def __init__(
        self,
        stats: CommStats,
        world: int,
        total_steps: int,
        log: MetricsLog,
        log_every: int,
        terminal: TextIO | None = None,
        log_file: TextIO | None = None,
        progress: bool = True,
    ):
        self.stats, self.world, self.log, self.log_every = stats, world, log, log_every
        self.terminal, self.log_file = terminal, log_file
        self.bar = tqdm(
            total=total_steps,
            file=terminal,
            disable=terminal is None or not progress,
            dynamic_ncols=True,
            mininterval=0.5,
            leave=True,
        )
        self.total, self.epoch, self.window = Timing(), Timing(), Timing()
        self._resumed = False
        self._ready = self._arrived = 0.0
        self._comm0 = 0.0

    def state_dict(self) -> dict[str, dict[str, float]]:
        return {"total": asdict(self.total), "epoch": asdict(self.epoch), "window": asdict(self.window)}

    def load_state_dict(self, state: dict[str, dict[str, float]], step: int, mid_epoch: bool) -> None:
        """Continue the timings of a checkpoint taken after ``step`` steps (the epoch's too, if mid-epoch)."""
        self.total, self.epoch, self.window = (Timing(**state[k]) for k in ("total", "epoch", "window"))
        self._resumed = mid_epoch
        self.bar.update(step)

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of one epoch; the time waiting for each one counts as data wait."""
        if not self._resumed:
            self.epoch = Timing()
        self._resumed = False
        self._ready = time.perf_counter()
        for batch in loader:
            self._arrived = time.perf_counter()
            self._comm0 = self.stats.seconds
            yield batch
            self._ready = time.perf_counter()

    def step_done(self, step: int, epoch: int, loss: float, samples: int, lr: float) -> None:
        """Account the step that just ended (``step`` counts steps done) and log or draw what is due."""
        now = time.perf_counter()
        comm = self.stats.seconds - self._comm0
        t = Timing(self._arrived - self._ready, now - self._arrived - comm, comm, samples, 1, loss)
        self.epoch.add(t)
        self.window.add(t)
        if step % self.log_every == 0:
            w = self.window
            self.log.write("step", step, epoch=epoch, loss=w.loss / w.steps, lr=lr, **w.rates(self.world))
            self.window = Timing()
        self.bar.update(1)
        rate = self.epoch.samples * self.world / max(self.epoch.total, 1e-9)
        self.bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", samples_s=f"{rate:.0f}", refresh=False)

    def epoch_done(self) -> Timing:
        """Close the epoch; returns its timing (also added to the run's total)."""
        self.total.add(self.epoch)
        return self.epoch

    def echo(self, text: str) -> None:
        """A line for this rank's log and, on rank 0, for the terminal (above the progress bar)."""
        if self.log_file is not None:
            self.log_file.write(text + "\n")
        if self.terminal is not None:
            if self.bar.disable:
                self.terminal.write(text + "\n")
            else:
                self.bar.write(text, file=self.terminal)

    def close(self) -> None:
        self.bar.close()
