"""Where a rank's output goes, and how its failure is named in one line.

Rank 0 writes to its log file and to the terminal (mpirun forwards it to the launcher); the other ranks only
to their log files. :func:`root_cause` is the line the launcher shows for a failed rank; :func:`end_job`
names it and ends the job.
"""

from __future__ import annotations

import re
import sys
import traceback
from pathlib import Path
from typing import TextIO

from runner.folder_files import make_folder, open_in_folder, write_text
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
    make_folder(run_dir / LOGS)  # (a link in its place is refused: the logs are the run folder's own)
    log = open_in_folder(rank_file(run_dir, rank, "log"), "a", buffering=1)
    terminal = sys.stdout
    if rank == 0:
        sys.stdout, sys.stderr = Tee(log, sys.stdout), Tee(log, sys.stderr)
    else:
        sys.stdout = sys.stderr = log
    return log, terminal


def root_cause(err: BaseException) -> str:
    """``Type: message (file:line)`` of the innermost exception that ``err`` was raised from or during.

    ``raise ... from None`` ends the chain: that error already says what went wrong."""
    while True:
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None or inner is err:
            break
        err = inner
    where = _where(err)
    text = str(err).strip()
    if ORIGINAL in text:  # raised again from a loader process: its own cause is in the message's traceback
        return from_loader_process(text)
    message = text.splitlines()[0] if text else "(no message)"
    return f"{type(err).__name__}: {message}{where}"


def _where(err: BaseException) -> str:
    """`` (file:line)`` for the cause's line, decided by the innermost frame outside the libraries.

    For the user's own code, its line; for the runner's, nothing for a refusal (a ValueError: its message
    names the key and the fix), else (a bug of the runner or a library) the innermost frame."""
    from runner.schema.trust import in_project, library_roots

    frames = traceback.extract_tb(err.__traceback__)
    libraries = library_roots()
    ours = [f for f in frames if not any(Path(f.filename).resolve().is_relative_to(r) for r in libraries)]
    ours = [f for f in ours if not f.filename.startswith("<")]  # (frozen modules: the standard library's)
    if ours and in_project(ours[-1].filename):
        frame = ours[-1]
    else:
        frame = None if isinstance(err, ValueError) or not frames else frames[-1]
    if frame is None:
        return ""
    path = Path(frame.filename)
    shown = path.relative_to(Path.cwd()) if path.is_absolute() and path.is_relative_to(Path.cwd()) else path
    return f" ({shown}:{frame.lineno})"


#: How torch re-raises a DataLoader worker process's exception: "Caught ValueError in DataLoader worker
#: process 0.", then this line and the process's own traceback, ending with its ``Type: message``.
ORIGINAL = "Original Traceback (most recent call last):"
FRAME = re.compile(r'^\s*File "(.+)", line (\d+)')


def from_loader_process(text: str) -> str:
    """``Type: message (file:line, in DataLoader worker process N)`` of the exception a loader process raised.

    Read from the message torch re-raised it with in the training process."""
    head, _, trace = text.partition(ORIGINAL)
    lines = [line for line in trace.splitlines() if line.strip()]
    frames = [m for line in lines if (m := FRAME.match(line))]
    where = f"{frames[-1].group(1)}:{frames[-1].group(2)}, " if frames else ""
    process = head.strip().removeprefix("Caught ").split(" in ", 1)[-1].rstrip(".")
    last = lines[-1].strip() if lines else head.strip()
    return f"{last} ({where}in {process})"


def end_job(run_dir: Path, rank: int, cause: str, status: int, detail: str = "") -> None:
    """Name this rank's failure and abort the job with ``status``.

    ``logs/rank<r>.error`` holds ``cause``, then ``detail``; a line goes on stderr, which the launcher
    shows. Callable from any thread (the main one may be blocked in MPI)."""
    from runner.comm import mpi

    try:
        write_text(rank_file(run_dir, rank, "error"), f"{cause}\n" + (f"\n{detail}" if detail else ""))
    except OSError as io:
        print(f"rank {rank}: could not write its error file: {io}", file=sys.stderr)
    print(f"rank {rank} failed: {cause}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.abort(status)
