"""One job per run folder: the launcher holds a lock on its run folder while its job runs.

The lock is an exclusive ``flock`` on ``RUN_DIR/job.lock`` (:data:`runner.run_folder.LOCK`), which holds
the pid, host and start time of its launcher. The kernel releases it when the launcher exits, however it
exits (a launcher killed by SIGKILL takes its job with it, see :mod:`runner.launcher.supervise`), so a lock
file left behind by a dead launcher blocks nothing. A second launch into the folder, or a second
``resume=`` of it while the first runs, is refused before anything is written there, naming the holder.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from runner.run_folder import CONFIG, LOCK, STOP


class RunFolderLock:
    """Holds ``run_dir``'s lock while in a ``with`` block. ``fresh``: a new run, refused in a folder that
    already holds one (its ``config.yaml``), with ``resume=`` and a fresh folder as the fixes. Raises
    ValueError (the launcher's "invalid input", exit 2); a folder that cannot be written is left to the
    launcher's own error for it."""

    def __init__(self, run_dir: Path, fresh: bool):
        self.run_dir, self.fresh = run_dir, fresh
        self.fd: int | None = None

    def __enter__(self) -> RunFolderLock:
        path = self.run_dir / LOCK
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # an unwritable or missing folder: the launcher names it when it writes there
            return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another launcher"
            self._close()
            raise ValueError(
                f"{self.run_dir} is in use by a running job ({holder}): wait for it to end, stop it "
                f"(touch {self.run_dir / STOP}), or give another folder (hydra.run.dir=...)"
            ) from None
        if self.fresh and (self.run_dir / CONFIG).exists():
            self._close()
            raise ValueError(
                f"{self.run_dir} already holds a run (its {CONFIG}): continue it with "
                f"resume={self.run_dir}, or give a fresh folder (leave hydra.run.dir out, or name a new one)"
            )
        holder = f"launcher pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}"
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (holder + "\n").encode(), 0)
        except OSError:  # a full disk: the lock holds all the same, without its holder's name
            pass
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close()

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None
