"""The launcher's progress bar: drawn in place from rank 0's progress records.

Open MPI's ``mpirun`` forwards a rank's output one whole line at a time, so a bar drawn by a rank (``\\r``
updates without a newline) would reach the terminal only with the next newline. Instead rank 0 writes
one record line (:data:`runner.run_folder.PROGRESS_RECORD`) a few times a second; :class:`ProgressTap`
takes them out of the job's output (they reach neither the terminal nor ``mpirun.log``) and
:class:`Bar` draws them in place on the launcher's own terminal, at its width of the moment, erasing
itself for every other line and drawing itself again below it.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from tqdm import tqdm

from runner.run_folder import PROGRESS_RECORD

#: The bar: percentage, bar, ``step n/total`` and the record's text (epoch, loss, samples/s, ETA).
BAR_FORMAT = "{percentage:3.0f}%|{bar}| step {n_fmt}/{total_fmt}{postfix}"
#: Without the bar, when the text leaves it no room.
NARROW_FORMAT = "{percentage:3.0f}% step {n_fmt}/{total_fmt}{postfix}"
#: The fewest columns of bar drawn.
MIN_BAR = 10
#: Seconds between two frames (the last record of an epoch or of the run is always drawn).
FRAME_EVERY_S = 0.2
#: Erases the terminal's line from the cursor on (ANSI "erase in line").
ERASE = b"\r\x1b[K"

MARK = PROGRESS_RECORD.encode()


class ProgressTap:
    """Splits the job's output into the bytes for the terminal and log and the progress records (dicts).

    Both come out in the order they came. Works on raw chunks: only a line start that could still become a
    record is held back."""

    def __init__(self) -> None:
        self.held = b""  # the start of a line that may be a record
        self.line_start = True

    def feed(self, data: bytes) -> list[bytes | dict[str, Any]]:
        parts: list[bytes | dict[str, Any]] = []
        out = bytearray()
        data, self.held = self.held + data, b""
        while data:
            if not self.line_start:
                cut = data.find(b"\n")
                if cut < 0:
                    out += data
                    break
                out += data[: cut + 1]
                data, self.line_start = data[cut + 1 :], True
                continue
            end = data.find(b"\n")
            line = data if end < 0 else data[: end + 1]
            if line.startswith(MARK):
                if end < 0:  # a record not whole yet
                    self.held = data
                    break
                parts += [bytes(out), *_parsed(line[len(MARK) :])]
                out.clear()
                data = data[end + 1 :]
            elif end < 0 and MARK.startswith(line):
                self.held = data
                break
            else:
                self.line_start = False
        parts.append(bytes(out))
        return [p for p in parts if p]


def _parsed(payload: bytes) -> list[dict[str, Any]]:
    try:
        record = json.loads(payload)
    except ValueError:
        return []
    return [record] if isinstance(record, dict) and {"n", "total"} <= record.keys() else []


class Bar:
    """Draws progress records in place on ``stream``.

    ``stream`` defaults to the launcher's standard output; ``prefix``: a sweep point's label. At most one
    frame every :data:`FRAME_EVERY_S`, the last record of an epoch (``final``) always. :meth:`write` and
    :meth:`above` put any other output above the bar; :meth:`close` leaves the last frame on the screen."""

    def __init__(
        self, stream: BinaryIO | None = None, prefix: bytes = b"", frame_every_s: float = FRAME_EVERY_S
    ):
        self.stream, self.prefix, self.frame_every_s = stream, prefix, frame_every_s
        self.lock = threading.RLock()  # the reader thread draws; the main thread (signals) may say things
        self.record: dict[str, Any] | None = None
        self.shown = False  # a frame is on the terminal's last line
        self.at_line_start = True  # the other output ended with a newline (the bar may be drawn)
        self.last_frame = 0.0

    def update(self, record: dict[str, Any]) -> None:
        """Show ``record`` (now, or with the next frame)."""
        with self.lock:
            self.record = record
            now = time.monotonic()
            if now - self.last_frame >= self.frame_every_s or record.get("final"):
                self._draw(now)

    def write(self, data: bytes) -> None:
        """Write other output above the bar, then draw the bar again below it."""
        if not data:
            return
        with self.lock:
            out = (ERASE if self.shown else b"") + data
            self.shown = False
            self.at_line_start = data.endswith(b"\n")
            self._emit(out)
            if self.record is not None:
                self._draw(time.monotonic())

    def above(self, say: Callable[[], None]) -> None:
        """Run ``say`` (which writes whole lines to the terminal) with the bar out of its way."""
        with self.lock:
            if self.shown:
                self._emit(ERASE)
                self.shown = False
            say()
            if self.record is not None:
                self._draw(time.monotonic())

    def close(self) -> None:
        """End the bar: its last frame stays on the screen; the next output starts on a line of its own."""
        with self.lock:
            if self.record is not None and not self.shown:
                self._draw(time.monotonic())
            if self.shown:
                self._emit(b"\n")
            self.shown, self.record = False, None

    def frame(self, record: dict[str, Any], columns: int) -> str:
        """One frame of ``record`` at most ``columns`` wide."""
        n, total = int(record["n"]), max(int(record["total"]), 1)
        postfix = record.get("text") or None  # tqdm puts ", " before it
        width = max(20, columns - len(self.prefix) - 1)
        narrow = tqdm.format_meter(min(n, total), total, 0.0, bar_format=NARROW_FORMAT, postfix=postfix)
        if len(narrow) + 2 + MIN_BAR > width:
            return narrow[:width]
        return tqdm.format_meter(
            min(n, total), total, 0.0, ncols=width, bar_format=BAR_FORMAT, postfix=postfix
        )

    def _draw(self, now: float) -> None:
        if not self.at_line_start or self.record is None:
            return
        columns = shutil.get_terminal_size().columns
        text = self.frame(self.record, columns)
        self._emit(ERASE + self.prefix + text.encode())
        self.shown, self.last_frame = True, now

    def _emit(self, data: bytes) -> None:
        try:
            stream = self.stream or sys.stdout.buffer
            stream.write(data)
            stream.flush()
        except (OSError, ValueError):
            pass
