"""Per-rank heartbeats for the launcher's stall watchdog, outside the training communicator.

Every rank rewrites ``RUN_DIR/logs/rank<r>.beat`` (JSON, atomically) once a second from a daemon thread:
its step and the time of its last progress, and the time of the write itself. A stopped process
(``kill -STOP``) stops writing altogether; a rank blocked inside MPI keeps writing (mpi4py releases the
GIL) while its progress time stands still, so the launcher can tell the stuck rank from those waiting on it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from runner.run_folder import STACKS, STACKS_SIGNAL, rank_file, write_atomic

INTERVAL_S = 1.0


class Heartbeat:
    """Call :meth:`progress` whenever the rank gets somewhere (a step, a phase).

    ``counter`` (read by the thread: this rank's seconds spent in communication calls) counts as progress
    whenever it moves, so a server that answers messages, or a worker that validates, is seen making
    progress too."""

    def __init__(self, run_dir: Path, rank: int, counter: Callable[[], float] | None = None):
        self.counter = counter
        self.last_count = counter() if counter else 0.0
        self.path = rank_file(run_dir, rank, "beat")
        self.record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "role": "worker"}
        self.step = -1
        self.progress_time = time.time()
        self.seconds = 0.0  # CPU spent writing beats (on its own thread): the summary's control time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        # the launcher's signal when it found the job stalled: every thread's stack, written in C (a thread
        # blocked inside MPI cannot run Python), to show where each rank waits
        self._stacks_path = rank_file(run_dir, rank, STACKS)
        self._stacks = self._stacks_path.open("w")
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True)
        self._write()
        self._thread.start()

    def progress(self, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.progress_time = time.time()

    def set_role(self, role: str) -> None:
        self.record["role"] = role

    def _write(self) -> None:
        start = time.thread_time()  # its CPU: a thread waiting for a core would count the wait
        record = {
            **self.record,
            "step": self.step,
            "progress_time": self.progress_time,
            "alive_time": time.time(),
        }
        try:
            write_atomic(self.path, json.dumps(record))
        except OSError:
            pass  # a full or read-only disk: the watchdog then sees this rank as silent, which it reports
        self.seconds += time.thread_time() - start

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            if self.counter is not None and (count := self.counter()) != self.last_count:
                self.last_count, self.progress_time = count, time.time()
            self._write()

    def close(self) -> None:
        """Stop beating and say so (``done``): a rank that has finished is not a stalled one."""
        self._stop.set()
        self._thread.join(timeout=2 * INTERVAL_S)
        self.record["done"] = True
        self._write()
        faulthandler.unregister(STACKS_SIGNAL)
        self._stacks.close()
        with contextlib.suppress(OSError):
            if self._stacks_path.stat().st_size == 0:
                self._stacks_path.unlink()
