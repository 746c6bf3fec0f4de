"""Run-folder records: metrics.jsonl (one JSON object per line) and TensorBoard events via tensorboardX."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends records to ``metrics.jsonl`` and TensorBoard; every record is flushed when written.

    Only the writing rank (rank 0) opens files; on other ranks every call is a no-op.
    """

    def __init__(self, run_dir: Path, enabled: bool, start: float | None = None):
        self.enabled = enabled
        self.start = time.time() if start is None else start
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1) if enabled else None
        if enabled:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), flush_secs=10)
        else:
            self.tb = None

    def write(self, kind: str, step: int, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.time() - self.start, 4), **values}
        self.file.write(json.dumps(record) + "\n")
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
