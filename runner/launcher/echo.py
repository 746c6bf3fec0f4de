"""What of a job's output reaches the terminal (all of it goes to ``mpirun.log``)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from runner.folder_files import open_in_folder
from runner.run_folder import parse_number


class ConsoleFormatter(logging.Formatter):
    """The launcher's console lines (``conf/hydra/job_logging/mpitrain.yaml``): the message alone.

    Its level comes first when it is not INFO (``warning: ...``, ``error: ...``); time and logger go to the
    log file."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno == logging.INFO else f"{record.levelname.lower()}: {text}"


class FolderFileHandler(logging.FileHandler):
    """The launcher's log file in the run folder (``cli.log``: ``conf/hydra/job_logging/mpitrain.yaml``).

    It is opened as a file of the folder's own (:func:`runner.folder_files.open_in_folder`) when the first
    line is written: Hydra makes the handler before the launcher checks the folder, so a link planted there is
    named by that check (exit 2), and no line is ever written where it points (the console has them all)."""

    def __init__(
        self, filename: str, mode: str = "a", encoding: str | None = None, delay: bool = True
    ) -> None:
        super().__init__(filename, mode, encoding, delay=True)
        self.refused = False

    def _open(self) -> Any:
        return open_in_folder(Path(self.baseFilename), self.mode, encoding=self.encoding, errors=self.errors)

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is None and not self.refused:
            try:
                self.stream = self._open()
            except OSError:  # a link or a pipe in its place, an unwritable folder: the console alone
                self.refused = True
        if self.stream is not None:
            logging.StreamHandler.emit(self, record)


class EchoFilter:
    """What of the job's output goes to the terminal.

    All but MPI's abort banners, Python tracebacks, the ranks' ``rank N failed:`` lines, Open MPI's notes on
    revoked collectives, its warning that osc/sm is untested under fault tolerance, its counts of repeated
    help messages and its ``--report-bindings`` lines (rank 0 says where the ranks run in one line; all are
    kept in ``mpirun.log``).

    Works on the raw chunks: a line is held back only while it could still be the start of something hidden,
    so progress bars (``\\r`` updates without a newline) pass at once. A dashed line is held until the next
    line says whether it opens an abort banner (hidden up to the closing dashes) or not (both are shown)."""

    DASHES = b"-" * 20
    TRACEBACK = (
        b"Traceback (most recent call last):",
        b"During handling of the above exception",
        b"The above exception was the direct cause",
    )
    BANNERS = (
        b"is not tested for post-failure",  # osc/sm under fault tolerance (the dynamic assignment's counter)
        b"MPI_ABORT was invoked",
        b"has exited due to process rank",
        b"noticed that process rank",
        b"detected that one or more processes exited",
    )
    #: Open MPI's notes on non-blocking collectives cut short when survivors of a lost rank revoke them
    #: (fault tolerance), each followed by an empty line: the runner says what happened instead.
    REVOKED = b"NBC_Progress: an error"
    #: ``--report-bindings``: ``[host:pid] Rank 0 bound to package[0][core:L0]`` (older: ``MCW rank 0``).
    BINDING = re.compile(rb"^\[[^\]]*:\d+\] (?:Rank|MCW rank) \d+ (?:bound|is not bound)")
    #: Open MPI's count of the same help message from other ranks (``2 more processes have sent help ...``).
    MORE_HELP = re.compile(rb"^\d+ more process(?:es)? ha(?:s|ve) sent help message")
    #: prterun's last words after a job into which processes were spawned (runner/rank/resilience/elastic.py),
    #: with no newline: the job ended as its ranks' records say.
    SPAWNED_END = b"LAUNCHER JOB OBJECT NOT FOUND"
    STARTS = (*TRACEBACK, b"rank ", REVOKED, SPAWNED_END, b"[", *(str(d).encode() for d in range(10)))

    def __init__(self) -> None:
        self.line = b""
        self.passing = False
        self.mode = "normal"
        self.held: list[bytes] = []
        self.tracebacks = 0
        #: The ``rank N failed: cause`` lines hidden, as (rank, cause): the causes of a job whose ranks could
        #: not write their error files (a read-only or full run folder).
        self.failures: list[tuple[int, str]] = []

    def _could_start(self, partial: bytes) -> bool:
        tail = partial.rsplit(b"\r", 1)[-1]
        if not tail.strip(b"-"):
            return True
        return any(s.startswith(tail) or tail.startswith(s) for s in self.STARTS)

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        for piece in re.split(b"(?<=\n)", data.replace(b"\0", b"")):  # prterun ends with a NUL
            if not piece:
                continue
            if self.passing:
                out += piece
                self.passing = not piece.endswith(b"\n")
                continue
            self.line += piece
            if self.line.endswith(b"\n"):
                line, self.line = self.line, b""
                out += self._complete(line)
            elif self.mode == "normal" and not self._could_start(self.line):
                out += self.line
                self.line, self.passing = b"", True
        return bytes(out)

    def flush(self) -> bytes:
        """At the end of the output: what is still held and was not hidden."""
        line = b"" if self.line.startswith(self.SPAWNED_END) else self.line
        rest = b"" if self.mode in ("banner", "traceback") else b"".join(self.held) + line
        self.held, self.line = [], b""
        return rest

    def _complete(self, line: bytes) -> bytes:
        text = line.rstrip(b"\r\n")
        dashes = text.startswith(self.DASHES) and not text.strip(b"-")
        if self.mode == "revoked":
            self.mode = "normal"
            if not text:
                return b""
        if text.startswith(self.REVOKED):
            self.mode = "revoked"
            return b""
        if text.startswith(self.SPAWNED_END):
            return b""
        if self.mode == "banner":
            self.mode = "normal" if dashes else "banner"
            return b""
        if self.mode == "traceback":
            self.tracebacks += text.startswith(self.TRACEBACK[0])
            continued = not text or text[:1] in (b" ", b"\t") or text.startswith(self.TRACEBACK)
            if not continued:  # the exception's own line, the traceback's last
                self.mode = "normal"
            return b""
        if self.mode == "pending":
            released, self.held = b"".join(self.held), []
            if any(b in text for b in self.BANNERS):
                self.mode = "banner"
                return b""
            self.mode = "normal"
            return released + self._complete(line)
        if dashes:
            self.mode, self.held = "pending", [line]
            return b""
        if text.startswith(self.TRACEBACK):
            self.mode = "traceback"
            self.tracebacks += text.startswith(self.TRACEBACK[0])
            return b""
        if text.startswith(b"rank ") and b" failed: " in text:
            rank, cause = text[5:].decode(errors="replace").split(" failed: ", 1)
            if (number := parse_number(rank)) is not None:
                self.failures.append((number, cause.strip()))
                return b""
        if self.BINDING.match(text) or self.MORE_HELP.match(text):
            return b""
        return line


def faults_line(summary: dict[str, Any]) -> str | None:
    """How the job's faults ended, in one line (None without any).

    Who was lost and when, who joined, the workers at the end and the time the survivors spent recovering."""
    failures, joins = summary.get("failures") or [], summary.get("joins") or []
    if not failures and not joins:
        return None
    lost = ", ".join(f"rank {f['rank']} at step {f['step']}" for f in failures)
    parts = [f"lost {lost}"] if lost else []
    if joins:
        parts.append("joined " + ", ".join(f"rank {j['rank']} at step {j['step']}" for j in joins))
    ended = "survived" if summary.get("status") == "ok" else f"ended {summary.get('status')}"
    seconds = summary.get("recovery_time_s") or 0.0
    return (
        f"faults: {'; '.join(parts)}; {ended} with {summary.get('workers_at_end')} workers at the end "
        f"(recovering took {seconds:.2f} s)"
    )
