"""Run-folder records: metrics.jsonl (one JSON object per line) and TensorBoard events via tensorboardX."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, so ``json.dumps`` writes strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON (NaN and infinities become null)."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)


class MetricsLog:
    """Appends records to ``metrics.jsonl`` and TensorBoard; every record is flushed when written.

    Only the writing rank (rank 0) opens files; on other ranks every call is a no-op. A resumed run passes
    ``resume=(lines, step, elapsed)`` from its checkpoint: ``metrics.jsonl`` is cut back to the ``lines``
    records written before that checkpoint, TensorBoard discards the earlier run's events after ``step``
    (``purge_step``), and times continue from ``elapsed`` seconds.
    """

    def __init__(self, run_dir: Path, enabled: bool, resume: tuple[int, int, float] | None = None):
        self.enabled = enabled
        self.lines = 0
        self.start = time.time() - (resume[2] if resume else 0.0)
        self.file = self.tb = None
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        if resume:
            kept = path.read_text().splitlines(keepends=True)[: resume[0]] if path.exists() else []
            path.write_text("".join(kept))
            self.lines = len(kept)
        self.file = open(path, "a", buffering=1)
        from tensorboardX import SummaryWriter

        purge = resume[1] + 1 if resume else None
        self.tb = SummaryWriter(str(run_dir / "tb"), flush_secs=10, purge_step=purge)

    def elapsed(self) -> float:
        return time.time() - self.start

    def write(self, kind: str, step: int, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.time() - self.start, 4), **values}
        self.file.write(dumps(record) + "\n")
        self.lines += 1
        for key, value in _scalars(values):
            self.tb.add_scalar(f"{kind}/{key}", value, step)

    def flush(self) -> None:
        if self.enabled:
            self.file.flush()
            self.tb.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.tb.close()


def _scalars(values: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """The finite numbers among ``values``; nested dicts (histograms) become ``key/subkey``."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((f"{prefix}{key}", float(value)))
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (a torn last line, from a killed job, is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
