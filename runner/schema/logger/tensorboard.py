"""TensorBoard event files in the run folder's ``tb/`` (the default logger).

rank/records/tracking/tensorboard_tracker.py writes them."""

from __future__ import annotations

from dataclasses import dataclass

from runner.schema.logger import LoggerConfig


@dataclass
class TensorBoardConfig(LoggerConfig):
    """Scalars of every record, the run's compared keys and its outcome for the HParams dashboard.

    Written in ``RUN_DIR/tb/<run name>/``; ``flush_secs``: the longest time a record waits in memory."""

    flush_secs: float = 10.0

    def __post_init__(self) -> None:
        self.require(
            self.flush_secs > 0, "flush_secs", self.flush_secs, "seconds between flushes, > 0 (e.g. 10)"
        )
