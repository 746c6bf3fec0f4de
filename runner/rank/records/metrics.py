"""Run-folder records: metrics.jsonl (one strict-JSON object per line), and the same records to the loggers.

The loggers are those chosen (``logger=[tensorboard,mlflow]``; :mod:`runner.rank.records.tracking`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from runner.folder_files import is_regular, open_in_folder, read_text, write_text
from runner.rank.records.output import root_cause
from runner.rank.records.tracking import RunInfo, Trackers, scalars
from runner.run_folder import METRICS, MODEL, SUMMARY, dumps, read_json
from runner.schema.logger import DEFAULT_LOGGERS, LoggerConfig


class MetricsLog:
    """Appends records to ``metrics.jsonl`` and the loggers' trackers.

    Every record is flushed to metrics.jsonl when written. Only the writing rank (rank 0) opens files and
    starts trackers; on other ranks every call is a no-op. ``loggers``: the config's ``logger`` (name ->
    schema; None: TensorBoard alone). A resumed run passes ``resume=(lines, step, elapsed)`` from its
    checkpoint: ``metrics.jsonl`` is cut back to the ``lines`` records written before that checkpoint,
    TensorBoard discards the earlier run's events after ``step`` (``purge_step``), MLflow and W&B continue
    the same run, and times continue from ``elapsed`` seconds. The run's end, its summary and model, go to
    the trackers with :meth:`finish`, after ``summary.json``.
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        resume: tuple[int, int, float] | None = None,
        loggers: dict[str, LoggerConfig | dict] | None = None,
    ):
        self.enabled, self.dir = enabled, run_dir
        self.loggers = {name: {} for name in DEFAULT_LOGGERS} if loggers is None else loggers
        self.lines = 0
        self.start = time.time() - (resume[2] if resume else 0.0)
        self.file = self.trackers = None
        if not enabled:
            return
        path = run_dir / METRICS  # (opened as the run folder's own file: never through a link)
        if resume:
            kept = _lines(path)[: resume[0]]
            write_text(path, "".join(kept))
            self.lines = len(kept)
        self.file = open_in_folder(path, "a", buffering=1)
        self.trackers = Trackers(self.loggers, RunInfo.read(run_dir, resume[1] if resume else None))

    def take_over(self) -> None:
        """This rank writes the records from now on (the writing rank was lost).

        It appends to what the lost rank wrote, without a line that rank may have left half-written; the
        trackers continue the run's records."""
        path = self.dir / METRICS
        kept = _lines(path)
        if kept and not kept[-1].endswith("\n"):
            kept.pop()
            write_text(path, "".join(kept))
        self.lines, self.enabled = len(kept), True
        self.file = open_in_folder(path, "a", buffering=1)
        self.trackers = Trackers(self.loggers, RunInfo.read(self.dir, continued=True))

    def elapsed(self) -> float:
        return time.time() - self.start

    def write(self, kind: str, step: int, at: float | None = None, **values: Any) -> None:
        """A record: a line of metrics.jsonl, and its numbers to every tracker (``<kind>/<key>``).

        ``at``: when it happened (``time.time()``; default now)."""
        if not self.enabled:
            return
        when = time.time() if at is None else at
        record = {"kind": kind, "step": step, "time": round(when - self.start, 4), **values}
        try:
            if self.file.closed:  # a late record (a worker lost at the job's closing meeting): the file only
                with open_in_folder(self.dir / METRICS, "a") as late:
                    late.write(dumps(record) + "\n")
                self.lines += 1
                return
            self.file.write(dumps(record) + "\n")
            self.lines += 1
            self.trackers.call("write", kind, step, scalars(values))
        except OSError as err:
            raise OSError(
                err.errno, f"cannot write the run's records in {self.dir}: {err.strerror}"
            ) from None

    def hparams(self, values: dict[str, Any], metrics: dict[str, float]) -> None:
        """The run's swept values and final metrics (TensorBoard's HParams dashboard)."""
        if self.enabled and values:
            self.trackers.call("hparams", values, metrics)

    def flush(self) -> None:
        if self.enabled:
            self.file.flush()
            self.trackers.call("flush")

    def close(self) -> None:
        """Close metrics.jsonl and the trackers' files.

        Called in a ``finally``: while an exception goes up, the trackers' runs end failed, with its cause;
        otherwise they wait for :meth:`finish`."""
        if not self.enabled:
            return
        self.file.close()
        self.trackers.call("close")
        failure = sys.exc_info()[1]
        if failure is not None:
            self.trackers.call("fail", root_cause(failure))
            self.trackers.live.clear()

    def finish(self) -> None:
        """The run's end to the trackers: ``summary.json``'s status and numbers, and ``model.pt`` when saved.

        Call it after both are written."""
        if not self.enabled or self.trackers is None:
            return
        model = self.dir / MODEL
        saved = model if is_regular(model) else None  # (a link's target is not the run's model to upload)
        self.trackers.call("finish", read_json(self.dir / SUMMARY), saved)
        self.trackers.live.clear()


def _lines(path: Path) -> list[str]:
    """The lines of ``metrics.jsonl`` with their ends ([] when there is none)."""
    try:
        return read_text(path).splitlines(keepends=True)
    except FileNotFoundError:
        return []
