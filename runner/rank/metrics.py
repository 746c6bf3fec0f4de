"""Run-folder records: metrics.jsonl (one strict-JSON object per line) and TensorBoard events."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from runner.run_folder import METRICS, TENSORBOARD, dumps


class MetricsLog:
    """Appends records to ``metrics.jsonl`` and TensorBoard; every record is flushed when written.

    Only the writing rank (rank 0) opens files; on other ranks every call is a no-op. A resumed run passes
    ``resume=(lines, step, elapsed)`` from its checkpoint: ``metrics.jsonl`` is cut back to the ``lines``
    records written before that checkpoint, TensorBoard discards the earlier run's events after ``step``
    (``purge_step``), and times continue from ``elapsed`` seconds.
    """

    def __init__(self, run_dir: Path, enabled: bool, resume: tuple[int, int, float] | None = None):
        self.enabled, self.dir = enabled, run_dir
        self.lines = 0
        self.start = time.time() - (resume[2] if resume else 0.0)
        self.file = self.tb = None
        if not enabled:
            return
        path = run_dir / METRICS
        if resume:
            kept = path.read_text().splitlines(keepends=True)[: resume[0]] if path.exists() else []
            path.write_text("".join(kept))
            self.lines = len(kept)
        self.file = open(path, "a", buffering=1)
        self.tb = EventFile(run_dir / TENSORBOARD, purge_step=resume[1] + 1 if resume else None)

    def take_over(self) -> None:
        """This rank writes the records from now on (the writing rank was lost): append to what it wrote,
        without a line it may have left half-written."""
        path = self.dir / METRICS
        text = path.read_text() if path.exists() else ""
        kept = text.splitlines(keepends=True)
        if kept and not kept[-1].endswith("\n"):
            kept.pop()
            path.write_text("".join(kept))
        self.lines, self.enabled = len(kept), True
        self.file = open(path, "a", buffering=1)
        self.tb = EventFile(self.dir / TENSORBOARD)

    def elapsed(self) -> float:
        return time.time() - self.start

    def write(self, kind: str, step: int, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.time() - self.start, 4), **values}
        try:
            self.file.write(dumps(record) + "\n")
            self.lines += 1
            for key, value in _scalars(values):
                self.tb.scalar(f"{kind}/{key}", value, step)
        except OSError as err:
            raise OSError(
                err.errno, f"cannot write the run's records in {self.dir}: {err.strerror}"
            ) from None

    def hparams(self, values: dict[str, Any], metrics: dict[str, float]) -> None:
        """The run's swept values and final metrics for TensorBoard's HParams dashboard."""
        if self.enabled and values:
            self.tb.hparams(values, metrics)

    def flush(self) -> None:
        if self.enabled:
            self.file.flush()
            self.tb.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.tb.close()


class EventFile:
    """TensorBoard scalars, written synchronously through tensorboardX's event writer and flushed every
    ``flush_secs``. (tensorboardX's ``SummaryWriter`` writes from a thread which, when the disk is full,
    dies and leaves the training process blocked on its queue; here the error reaches the rank.)
    ``purge_step`` makes TensorBoard drop the earlier events of this folder from that step on (a resume).
    """

    def __init__(self, logdir: Path, purge_step: int | None = None, flush_secs: float = 10.0):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        logdir.mkdir(exist_ok=True)
        self.writer, self.event = EventsWriter(str(logdir / "events")), Event
        self.flush_secs, self.flushed = flush_secs, time.time()
        if purge_step is not None:
            self.writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.writer.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboardX.summary import scalar

        self.writer.write_event(self.event(wall_time=time.time(), step=step, summary=scalar(tag, value)))
        if time.time() - self.flushed > self.flush_secs:
            self.flush()

    def hparams(self, values: dict[str, Any], metrics: dict[str, float]) -> None:
        """tensorboardX's three hparams summaries (the experiment, the session's values, its end) and the
        metrics as scalars under their own tags, as ``SummaryWriter.add_hparams`` writes them."""
        from tensorboardX.summary import hparams

        shown = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
        finite = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for summary in hparams(shown, finite):
            self.writer.write_event(self.event(wall_time=time.time(), summary=summary))
        for key, value in finite.items():
            self.scalar(key, value, 0)
        self.flush()

    def flush(self) -> None:
        self.writer.flush()
        self.flushed = time.time()

    def close(self) -> None:
        self.writer.close()


def _scalars(values: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """The finite numbers among ``values``; nested dicts (histograms) become ``key/subkey``."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((f"{prefix}{key}", float(value)))
    return out
