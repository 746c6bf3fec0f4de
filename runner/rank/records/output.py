"""Where a rank's output goes, and how its failure is named in one line.

Rank 0 writes to its log file and to the terminal (mpirun forwards it to the launcher); the other ranks only
to their log files. :func:`root_cause` is the line the launcher shows for a failed rank.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import TextIO

from runner.run_folder import LOGS, rank_file


class Tee:
    """A text stream that writes to several streams."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False


def redirect_output(run_dir: Path, rank: int) -> tuple[TextIO, TextIO]:
    """Send this rank's stdout/stderr to its log file (rank 0: and to the terminal).

    Returns ``(log, terminal)``: the log file, and the terminal stream for rank 0's progress bar.
    """
    logs = run_dir / LOGS
    logs.mkdir(exist_ok=True)
    log = open(rank_file(run_dir, rank, "log"), "a", buffering=1)
    terminal = sys.stdout
    if rank == 0:
        sys.stdout, sys.stderr = Tee(log, sys.stdout), Tee(log, sys.stderr)
    else:
        sys.stdout = sys.stderr = log
    return log, terminal


def root_cause(err: BaseException) -> str:
    """``Type: message (file:line)`` of the innermost exception that ``err`` was raised from or during
    (``raise ... from None`` ends the chain: that error already says what went wrong)."""
    while True:
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None or inner is err:
            break
        err = inner
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(err).strip().splitlines()[0] if str(err).strip() else "(no message)"
    return f"{type(err).__name__}: {message}{where}"
