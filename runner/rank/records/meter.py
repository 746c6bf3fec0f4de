"""Step accounting for the training loop: timing, the logging window, the progress records and echoed lines.

A step's time is split into data wait (until the batch arrived), exposed communication (seconds the rule
spent inside the communication layer during the step, so overlapped communication that does not hold the
step up is not counted) and compute (the rest).

Rank 0 shows the run's progress (step/total, epoch, loss, samples/s of all workers, ETA) as :func:`display`
decides. Open MPI gives every rank a pseudo-terminal of 0×0 columns whatever the launcher's output is, and
forwards a rank's output one whole line at a time, so the rank neither knows the terminal nor could draw a
live bar on it: the launcher says (:data:`TTY_ENV`, set by :func:`runner.hardware.mpirun.rank_env`). To a
terminal, rank 0 writes a progress record line (:data:`PROGRESS_RECORD`) at most every
:data:`RECORD_EVERY_S` seconds and the launcher draws the bar from them (:mod:`runner.launcher.progress`);
to anything else (a pipe, a file, CI logs) a plain line every :data:`LINE_EVERY_S` seconds and at the end
of every epoch. Records and lines go to the terminal stream only, never to the rank's log file;
:meth:`Meter.echo`'s lines go to both.

The loss stays where the step computed it: a step's loss is a 0-dim tensor on the training device, summed
there (in float64, so the sums equal those of Python floats), and read by the host only where it is
recorded or shown (:class:`Peek`): a GPU step waits for no host synchronisation.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from tqdm import tqdm

from runner.comm import CommStats
from runner.rank.records.metrics import MetricsLog
from runner.run_folder import PROGRESS_RECORD, TTY_ENV

#: Seconds between two progress lines when the output is not a terminal.
LINE_EVERY_S = 30.0
#: Seconds between two progress records for the launcher's bar.
RECORD_EVERY_S = 0.2


@dataclass(frozen=True)
class Display:
    """How progress is shown: ``bar``, ``lines`` or ``none``.

    ``bar``: records for the launcher's bar; ``lines``: plain, now and then."""

    mode: str


def display(progress: bool, terminal: TextIO | None, environ: Mapping[str, str] = os.environ) -> Display:
    """How to show progress on ``terminal`` (``None``: this rank shows none) with ``train.progress``.

    A bar when the launcher says its output is a terminal (:data:`TTY_ENV`), plain lines otherwise (also for
    a worker started by hand: no launcher draws its bar)."""
    if not progress or terminal is None:
        return Display("none")
    return Display("bar" if environ.get(TTY_ENV, "").strip() == "1" else "lines")


def progress_record(step: int, total: int, text: str, final: bool = False) -> str:
    """The record line the launcher draws the bar from (:mod:`runner.launcher.progress`)."""
    return PROGRESS_RECORD + json.dumps({"n": step, "total": total, "text": text, "final": final}) + "\n"


def progress_text(epoch: int, loss: float, samples_s: float, eta_s: float | None) -> str:
    """What the bar shows after its ``step N/M``: epoch, loss, samples/s and the time left."""
    eta = "?" if eta_s is None else tqdm.format_interval(eta_s)
    return f"epoch {epoch}, loss {loss:.4f}, {samples_s:,.0f} samples/s, ETA {eta}"


def progress_line(
    step: int, total: int, epoch: int, loss: float, samples_s: float, eta_s: float | None
) -> str:
    """The plain progress line (output that is not a terminal)."""
    percent = f" ({100 * step / total:.0f}%)" if total else ""
    return f"step {step}/{total}{percent}, " + progress_text(epoch, loss, samples_s, eta_s)


class Peek:
    """The value of a loss on the device as the host can read it without waiting.

    For progress shown between steps: a copy to pinned memory is started behind the device's work and read
    once it has arrived, so the value shown may be a step or two old. On the CPU, or ``exact``, the value
    itself."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None  # pinned
        self.arrived: torch.cuda.Event | None = None  # the copy in flight
        self.known: float | None = None

    def __call__(self, loss: float | torch.Tensor, exact: bool = False) -> float:
        if not isinstance(loss, torch.Tensor) or loss.device.type != "cuda" or exact:
            return float(loss)
        if self.arrived is not None and self.arrived.query():
            self.known, self.arrived = self.host.item(), None
        if self.arrived is None:
            if self.host is None:
                self.host = torch.empty((), dtype=torch.float64, pin_memory=True)
            self.host.copy_(loss.detach().double(), non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record()
        return float(loss) if self.known is None else self.known  # the first: wait for it once


@dataclass
class Timing:
    """Seconds of a span of steps, split into data wait, compute and (exposed) communication.

    It also holds the sum of its steps' losses (a float64 tensor on the training device while steps are
    added: ``float()`` it where it is read); ``emulated``: the part of ``comm`` spent waiting on emulated
    links (``simulate.link_gbps``, :mod:`runner.comm.links`)."""

    data: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    samples: int = 0
    steps: int = 0
    loss: float | torch.Tensor = 0.0
    emulated: float = 0.0

    @property
    def total(self) -> float:
        return self.data + self.compute + self.comm

    def add(self, other: Timing) -> None:
        self.data += other.data
        self.compute += other.compute
        self.comm += other.comm
        self.samples += other.samples
        self.steps += other.steps
        self.loss = self.loss + other.loss  # (a new tensor: a span's sum is never another's)
        self.emulated += other.emulated

    def rates(self, world: int, tokens_per_sample: int | None = None) -> dict[str, float]:
        """Throughput and the split of the step time.

        Throughput is samples/s of all ``world`` workers, and tokens/s where a sample holds
        ``tokens_per_sample`` (a language model's)."""
        total = max(self.total, 1e-12)
        per = tokens_per_sample
        tokens = {"tokens_per_s": self.samples * world * per / total} if per else {}
        return {
            "samples_per_s": self.samples * world / total,
            **tokens,
            "compute_frac": self.compute / total,
            "comm_frac": self.comm / total,
            "emulated_comm_frac": self.emulated / total,  # the part of comm_frac spent on emulated links
            "data_frac": self.data / total,
            "step_ms": 1e3 * total / max(1, self.steps),
        }


class Meter:
    """Times a run's steps, writes a ``step`` record every ``log_every`` steps, and shows rank 0's progress.

    Progress is shown on ``terminal`` (:func:`display`; ``line_every_s``: seconds between plain lines).
    The last progress of an epoch and of the run is always written.

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
        line_every_s: float = LINE_EVERY_S,
        tokens_per_sample: int | None = None,
    ):
        self.stats, self.world, self.log, self.log_every = stats, world, log, log_every
        self.terminal, self.log_file = terminal, log_file
        self.total_steps, self.line_every_s = total_steps, line_every_s
        self.display = display(progress, terminal)
        self.every_s = RECORD_EVERY_S if self.display.mode == "bar" else line_every_s
        self.tokens_per_sample = tokens_per_sample  # a language model's: tokens/s beside samples/s
        self.total, self.epoch, self.window = Timing(), Timing(), Timing()
        self._resumed = False
        self._ready = self._arrived = 0.0
        self._comm0 = self._emulated0 = 0.0
        self._start, self._first_step = time.monotonic(), 0
        self._last_line = self._start if self.display.mode == "lines" else 0.0  # a bar: at the first step
        self._pending: tuple[int, int, float | torch.Tensor, float, float | None] | None = None
        self._loss: float | torch.Tensor | None = None  # the last step's, for progress shown between steps
        self._peek = Peek()
        self._shown = 0  # the last step shown
        self._progress = 0  # the run's progress, in steps (shown or not)
        self.job_samples = 0.0  # every worker's samples as of the last count, the same on each (count_job)
        self._counted = 0.0  # this worker's total samples at that count
        self._links_seen = -math.inf  # the job clock's second up to which link events were recorded

    def state_dict(self) -> dict[str, dict[str, float]]:
        """The timings, their losses read (a host synchronisation), and the job-wide sample count."""
        spans = {"total": self.total, "epoch": self.epoch, "window": self.window}
        job = {"job": {"samples": self.job_samples, "counted": self._counted}}
        return {k: {**vars(t), "loss": float(t.loss)} for k, t in spans.items()} | job

    def load_state_dict(self, state: dict[str, dict[str, float]], step: int, mid_epoch: bool) -> None:
        """Continue the timings of a checkpoint taken after ``step`` steps (the epoch's too, if mid-epoch)."""
        self.total, self.epoch, self.window = (Timing(**state[k]) for k in ("total", "epoch", "window"))
        job = state.get("job") or {"samples": 0.0, "counted": 0.0}  # (older ones: each its whole total)
        self.job_samples, self._counted = job["samples"], job["counted"]
        self._resumed = mid_epoch
        self._start, self._first_step = time.monotonic(), step

    def new_samples(self) -> float:
        """This worker's samples since the job-wide count was last taken (:meth:`count_job`)."""
        return self.total.samples - self._counted

    def count_job(self, new: float) -> None:
        """Every worker, once the count is agreed: the job's samples trained so far grow by ``new``.

        ``new`` is the sum of the workers' :meth:`new_samples`; a retry after a loss takes the count again.
        A worker lost since the last count takes its new ones with it; a joined one counts from its join."""
        self.job_samples += new
        self._counted = self.total.samples

    def rebase(self) -> None:
        """A worker that joined took worker 0's records: its own samples count from now.

        Within an epoch it took its timing too, which the epoch's end adds to the total."""
        self._counted = self.total.samples + (self.epoch.samples if self._resumed else 0)

    def forget_epoch(self) -> None:
        """The epoch's timing was added to the run's total.

        A checkpoint within the epoch taken now (a train.max_steps cut) leaves a resumed run to time the
        rest alone, not to count it twice."""
        self.epoch = Timing()

    @property
    def shown_step(self) -> int:
        """The run's progress in steps, as the bar shows it."""
        return self._progress

    def replan(self, total_steps: int) -> None:
        """The run will take ``total_steps`` steps after all (survivors of a lost worker: longer epochs)."""
        self.total_steps = total_steps

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of one epoch; the time waiting for each one counts as data wait."""
        if not self._resumed:
            self.epoch = Timing()
        self._resumed = False
        self._ready = time.perf_counter()
        for batch in loader:
            self._arrived = time.perf_counter()
            self._comm0, self._emulated0 = self.stats.seconds, self.stats.emulated_seconds
            yield batch
            self._ready = time.perf_counter()

    def restart_step(self) -> None:
        """The step starts now: what came since its batch arrived is not the step's time.

        For example a meeting of the workers, or a validation."""
        self._arrived, self._comm0 = time.perf_counter(), self.stats.seconds
        self._emulated0 = self.stats.emulated_seconds

    def _link_edges(self, step: int) -> None:
        """``link`` records of the emulated links' events that began or ended since the last step."""
        links = self.stats.links
        now = links.now()
        for at, event, began in links.edges(self._links_seen, now):
            gbps = event.gbps if began else None
            state = ("down" if event.gbps is None else "slowed") if began else "restored"
            self.log.write("link", step, node=event.node, state=state, gbps=gbps, at_s=round(at, 3))
        self._links_seen = now

    def step_done(
        self,
        step: int,
        epoch: int,
        loss: float | torch.Tensor,
        samples: int,
        lr: float,
        shown: int | None = None,
    ) -> None:
        """Account the step that just ended and log or draw what is due.

        ``step`` counts steps done; ``loss``: its loss, a number or a 0-dim tensor left on its device;
        ``shown``: the run's progress in steps, where it is not this worker's count (dynamic assignment)."""
        now = time.perf_counter()
        comm = self.stats.seconds - self._comm0
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().double()
        t = Timing(self._arrived - self._ready, now - self._arrived - comm, comm, samples, 1, loss)
        t.emulated = self.stats.emulated_seconds - self._emulated0
        self.epoch.add(t)
        self.window.add(t)
        if step % self.log_every == 0:
            w = self.window
            mean = float(w.loss) / w.steps
            rates = w.rates(self.world, self.tokens_per_sample)
            self.log.write("step", step, epoch=epoch, loss=mean, lr=lr, **rates)
            self.window = Timing()
        self._loss = loss
        self._progress = step if shown is None else shown
        if self.stats.links is not None and self.stats.links.events:
            self._link_edges(step)
        if self.display.mode != "none":
            self._show(step if shown is None else shown, epoch, loss)

    def reach(self, step: int, epoch: int) -> None:
        """The run's progress stands at ``step``.

        Dynamic assignment: every worker has trained the chunks up to the epoch's end, wherever this
        worker's own last chunk was."""
        self._progress = max(self._progress, step)
        if self.display.mode != "none" and self._loss is not None and step > self._shown:
            self._show(step, epoch, self._loss)

    def _show(self, step: int, epoch: int, loss: float | torch.Tensor) -> None:
        clock, self._shown = time.monotonic(), step
        done, elapsed = step - self._first_step, clock - self._start
        eta = (self.total_steps - step) * elapsed / done if done > 0 and step <= self.total_steps else None
        rate = self.epoch.samples * self.world / max(self.epoch.total, 1e-9)
        self._pending = (step, epoch, loss, rate, eta)
        if clock - self._last_line >= self.every_s:
            self._write_pending()

    def _write_pending(self, final: bool = False) -> None:
        if self._pending is not None and self.terminal is not None:
            step, epoch, loss, rate, eta = self._pending
            loss = self._peek(loss, exact=final)
            if self.display.mode == "bar":
                text = progress_record(step, self.total_steps, progress_text(epoch, loss, rate, eta), final)
            else:
                text = progress_line(step, self.total_steps, epoch, loss, rate, eta) + "\n"
            self.terminal.write(text)
            self.terminal.flush()
        self._pending, self._last_line = None, time.monotonic()

    def epoch_done(self) -> Timing:
        """Close the epoch (writing its last progress); returns its timing (also added to the run's total)."""
        self.total.add(self.epoch)
        self._write_pending(final=True)
        return self.epoch

    def echo(self, text: str) -> None:
        """A line for this rank's log and, on rank 0, for the terminal (drawn above the launcher's bar)."""
        if self.log_file is not None:
            self.log_file.write(text + "\n")
        if self.terminal is not None:
            self.terminal.write(text + "\n")
            self.terminal.flush()

    def close(self) -> None:
        """Write the last progress not yet written."""
        self._write_pending(final=True)
