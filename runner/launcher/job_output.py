"""A job's output as the launcher passes it on: whole to ``mpirun.log``, filtered to the terminal.

Open MPI's abort banners, Python tracebacks and the ranks' ``rank N failed:`` lines are left out of the
terminal (:mod:`runner.launcher.echo`); rank 0's progress records are drawn as the progress bar
(:mod:`runner.launcher.progress`); a sweep point's lines are labelled; the launcher's own lines go above the
bar."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import BinaryIO

from runner.folder_files import open_in_folder
from runner.launcher.echo import EchoFilter
from runner.launcher.progress import Bar, ProgressTap
from runner.run_folder import MPIRUN_LOG


def _log(text: str) -> None:
    logging.getLogger("runner").warning(text)


class JobOutput:
    """The output of the job of ``run_dir``; ``label``: a sweep point's, at the start of its lines."""

    def __init__(self, run_dir: Path, label: str | None = None):
        self.log_path = run_dir / MPIRUN_LOG
        self.prefix = f"[{label}] ".encode() if label else b""
        self.line_start = True
        self.filter = EchoFilter()
        self.tap = ProgressTap()
        self.bar = Bar(prefix=self.prefix)

    def say(self, text: str) -> None:
        """One of the launcher's own lines, above the progress bar (labelled as the job's are)."""
        self.bar.above(lambda: _log(self.prefix.decode() + text))

    def copy(self, fd: int) -> None:
        """Copy what ``fd`` (the job's output) gives to mpirun.log and, filtered, to the terminal.

        It copies until the output ends. A log that cannot be written (full disk) is reported once and
        dropped; the pipe is drained regardless, so the job never blocks on its output."""
        log: BinaryIO | None
        try:
            log = open_in_folder(self.log_path, "ab")  # (never through a link)
        except OSError as err:
            log = None
            self.say(f"cannot write {self.log_path}: {err}; the output goes to the terminal alone")
        while data := os.read(fd, 65536):
            parts = self.tap.feed(data)
            chunk = b"".join(p for p in parts if isinstance(p, bytes))
            if log is not None and chunk:
                try:
                    log.write(chunk)
                    log.flush()
                except OSError as err:
                    self.say(f"cannot write {self.log_path}: {err}; it stops here")
                    _close_quietly(log)
                    log = None
            for part in parts:
                if isinstance(part, bytes):
                    self._echo(self.filter.feed(part))
                else:
                    self.bar.update(part)
        self._echo(self.filter.flush())
        self.bar.close()
        if log is not None:
            _close_quietly(log)

    def _echo(self, data: bytes) -> None:
        """Write to the terminal; with a label (a sweep's point), at the start of every line."""
        if not data:
            return
        if self.prefix:
            lines = data.split(b"\n")
            data = b"\n".join(
                (self.prefix if (i > 0 or self.line_start) and line else b"") + line
                for i, line in enumerate(lines)
            )
            self.line_start = data.endswith(b"\n")
        self.bar.write(data)


def _close_quietly(stream: BinaryIO) -> None:
    try:
        stream.close()
    except OSError:
        pass
