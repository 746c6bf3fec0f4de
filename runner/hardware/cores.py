"""Cores held by the jobs that run at once on this machine.

Such jobs are a sweep's points run in parallel by joblib or ``submitit_local``; each job binds its ranks to
cores no other job uses.

A job holds a core by an exclusive ``flock`` on ``<tmp>/mpitrain-cores/core<c>.lock`` for as long as the
launcher runs it; the kernel drops the lock when the launcher exits, however it exits, so no stale lock
outlives a job.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO

LOCK_DIR = Path(os.environ.get("MPITRAIN_CORE_LOCKS", Path(tempfile.gettempdir()) / "mpitrain-cores"))


class CoreLease:
    """The cores this launcher holds (``cores``, in the order taken) until :meth:`release`."""

    def __init__(self, cores: list[int], files: list[IO[bytes]]):
        self.cores, self._files = cores, files

    def release(self) -> None:
        for f in self._files:
            f.close()
        self._files, self.cores = [], []


def reserve(count: int, allowed: list[int]) -> CoreLease:
    """Hold up to ``count`` of the ``allowed`` cores that no other job holds, lowest first."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    cores, files = [], []
    for core in allowed:
        if len(cores) == count:
            break
        f = open(LOCK_DIR / f"core{core}.lock", "wb")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        cores.append(core)
        files.append(f)
    return CoreLease(cores, files)
