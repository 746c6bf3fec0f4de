"""What a tracker is: one logger's records of the run, on the writing rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Tracker:
    """One logger's records of the run, on the writing rank.

    ``optional``: a failure of this tracker is named and leaves it out, rather than ending the run
    (:class:`Trackers`)."""

    optional = True

    def write(self, kind: str, step: int, values: list[tuple[str, float]]) -> None:
        """A record's numbers (``values``: ``(key, value)``), at optimizer step ``step``."""

    def hparams(self, values: dict[str, Any], metrics: dict[str, float]) -> None:
        """The run's swept values and final metrics, when training is done."""

    def flush(self) -> None:
        """Everything written so far to its store."""

    def close(self) -> None:
        """No more records (the metrics file is closed); the run's end comes with :meth:`finish`."""

    def finish(self, summary: dict[str, Any], model: Path | None) -> None:
        """The run ended: its ``summary.json`` and its saved model (None: none was saved)."""

    def fail(self, cause: str) -> None:
        """The run failed with ``cause`` (one line)."""
