"""TensorBoard's tracker.

Event files in ``RUN_DIR/tb/<run name>/``, the compared keys as hparams, the outcome as scalars."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from runner.rank.records.tracking.base import Tracker
from runner.rank.records.tracking.run_info import (
    RunInfo,
    compared,
    folder_name,
    hparam_kinds,
    summary_numbers,
    text,
    trial_name,
)
from runner.run_folder import TENSORBOARD
from runner.schema.logger.tensorboard import TensorBoardConfig

#: The prefix of the outcome's TensorBoard tags: upper case sorts before every record's (``center/``,
#: ``epoch/``), so TensorBoard's HParams table, which lists metrics by tag and ticks the first five,
#: shows these.
OUTCOME = "Outcome/"

#: The summary's numbers that make the outcome, beside ``final_`` and ``best_`` of the monitored metric, as
#: the writing rank has them (the launcher adds ``wall_time_s``, start-up included, after the ranks end).
OUTCOME_KEYS = ("final_val_loss", "steps", "steps_to_target", "time_to_target_s", "worker_wall_time_s")


class EventFile:
    """TensorBoard events, written synchronously through tensorboardX's event writer.

    They are flushed every ``flush_secs``. (tensorboardX's ``SummaryWriter`` writes from a thread which, when
    the disk is full, dies and leaves the training process blocked on its queue; here the error reaches the
    rank.) ``purge_step`` makes TensorBoard drop the earlier events of this folder from that step on (a
    resume).
    """

    def __init__(self, logdir: Path, purge_step: int | None = None, flush_secs: float = 10.0):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        logdir.mkdir(parents=True, exist_ok=True)
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

    def session(self, **info: Any) -> None:
        """One of the HParams plugin's records (``HParamsPluginData``), given as its one field.

        ``session_start_info=`` or ``session_end_info=``."""
        from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
        from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

        (which,) = info
        data = HParamsPluginData(version=0, **info)
        plugin = SummaryMetadata.PluginData(plugin_name="hparams", content=data.SerializeToString())
        value = Summary.Value(tag=f"_hparams_/{which}", metadata=SummaryMetadata(plugin_data=plugin))
        self.writer.write_event(self.event(wall_time=time.time(), summary=Summary(value=[value])))
        self.flush()

    def flush(self) -> None:
        self.writer.flush()
        self.flushed = time.time()

    def close(self) -> None:
        self.writer.close()


def tensorboard_dir(run_dir: Path, name: str) -> Path:
    """Where the run's event files go.

    ``tb/<run name>/`` (TensorBoard shows the folder as the run's name), or ``tb/`` itself for a run folder
    whose events are there already (written before run names)."""
    tb = run_dir / TENSORBOARD
    if any(tb.glob("events.out.tfevents.*")):
        return tb
    return tb / folder_name(name)


def session_start(values: dict[str, Any], group: str) -> Any:
    """The HParams plugin's session start.

    ``values`` as its hparams, each of the kind its key is given in every run (:func:`hparam_kinds`; a text
    key's value as text: ``0.5``, ``n/a``, ``null``); a key no schema declares (a swept ``+model.width``)
    as its value is (a value neither bool, number nor string as JSON text: ``null``, ``[1]``); ``group``
    as its trial's name."""
    from tensorboardX.proto.plugin_hparams_pb2 import SessionStartInfo

    info = SessionStartInfo(group_name=group, start_time_secs=time.time())
    kinds = hparam_kinds()
    for key, value in values.items():
        if kinds.get(key) == "text":
            info.hparams[key].string_value = text(value)
        elif isinstance(value, bool):
            info.hparams[key].bool_value = value
        elif isinstance(value, (int, float)) and math.isfinite(value):
            info.hparams[key].number_value = float(value)
        else:
            info.hparams[key].string_value = text(value)
    return info


def session_end(status: str) -> Any:
    """The HParams plugin's session end, for ``summary.json``'s status."""
    from tensorboardX.proto.api_pb2 import Status
    from tensorboardX.proto.plugin_hparams_pb2 import SessionEndInfo

    ended = {"ok": "STATUS_SUCCESS", "preempted": "STATUS_RUNNING", "interrupted": "STATUS_RUNNING"}
    return SessionEndInfo(status=Status.Value(ended.get(status, "STATUS_FAILURE")), end_time_secs=time.time())


def outcome(summary: dict[str, Any], monitor: str | None) -> dict[str, float]:
    """The run's outcome from ``summary.json`` as :data:`OUTCOME` tags.

    Final and best of the monitored metric (``monitor``; None: the summary's, else val_acc when recorded, else
    val_loss), then :data:`OUTCOME_KEYS` recorded."""
    monitor = monitor or summary.get("monitor")
    if not monitor:
        monitor = "val_acc" if summary.get("final_val_acc") is not None else "val_loss"
    keys = (f"final_{monitor}", f"best_{monitor}", *OUTCOME_KEYS)
    numbers = summary_numbers(summary)
    return {f"{OUTCOME}{k}": numbers[k] for k in dict.fromkeys(keys) if k in numbers}


class TensorBoardTracker(Tracker):
    """TensorBoard's records of the run: scalars, hparams and the outcome.

    Every record's numbers as scalars (tag ``<kind>/<key>``), the compared keys as the run's hparams, and
    the outcome (:func:`outcome`) with the session's end when the run ends."""

    optional = False

    def __init__(self, cfg: TensorBoardConfig, run: RunInfo):
        purge = None if run.resume_step is None else run.resume_step + 1
        self.events = EventFile(tensorboard_dir(run.dir, run.name), purge, cfg.flush_secs)
        self.monitor = (run.config.get("train") or {}).get("monitor")
        self.events.session(session_start_info=session_start(compared(run), trial_name(run)))

    def write(self, kind: str, step: int, values: list[tuple[str, float]]) -> None:
        for key, value in values:
            self.events.scalar(f"{kind}/{key}", value, step)

    def hparams(self, values: dict[str, Any], metrics: dict[str, float]) -> None:
        """Learn the monitored metric (``hparam/final_<monitor>``); the outcome comes with the summary."""
        for key in metrics:
            if key.startswith("hparam/final_"):
                self.monitor = key.removeprefix("hparam/final_")

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        """Flushed: the outcome and the session's end follow with :meth:`finish` or :meth:`fail`."""
        self.events.flush()

    def finish(self, summary: dict[str, Any], model: Path | None) -> None:
        step = int(summary.get("steps") or 0)
        for tag, value in outcome(summary, self.monitor).items():
            self.events.scalar(tag, value, step)
        self.events.session(session_end_info=session_end(str(summary.get("status", "ok"))))
        self.events.close()

    def fail(self, cause: str) -> None:
        self.events.session(session_end_info=session_end("failed"))
        self.events.close()
