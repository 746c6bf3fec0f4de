"""One job per run folder: the launcher holds a lock on its run folder while its job runs.

The lock is an exclusive ``flock`` on ``RUN_DIR/job.lock`` (:data:`runner.run_folder.LOCK`), which holds
the pid, host and start time of its launcher. The kernel releases it when the launcher exits, however it
exits (a launcher killed by SIGKILL takes its job with it, see :mod:`runner.launcher.supervise`), so a lock
file left behind by a dead launcher blocks nothing. A second launch into the folder, or a second
``resume=`` of it while the first runs, is refused before anything is written there, naming the holder.

A folder holding a symbolic link or a special file among its files (:func:`runner.run_folder.foreign_files`:
one planted to make the runner write elsewhere, such as ``job.lock`` linked to a file of the user's) is
refused before the lock file is opened, naming each; the lock file itself is opened as a regular file of
the folder, never through a link.

The lock fails closed: a lock file that cannot be opened or locked (a directory in its place, a folder
that cannot be read or written, a file system without ``flock``) refuses the job, naming the file and the
fix, rather than running it unguarded beside another.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from runner.folder_files import ForeignFile, foreign_refusal, open_fd
from runner.run_folder import CONFIG, LOCK, STOP, foreign_files


class RunFolderLock:
    """Holds ``run_dir``'s lock while in a ``with`` block.

    ``fresh``: a new run, refused in a folder that already holds one (its ``config.yaml``), with ``resume=``
    and a fresh folder as the fixes. Raises ValueError (the launcher's "invalid input", exit 2), also when the
    lock cannot be taken at all (it fails closed: :meth:`_cannot_lock`)."""

    def __init__(self, run_dir: Path, fresh: bool):
        self.run_dir, self.fresh = run_dir, fresh
        self.fd: int | None = None

    def __enter__(self) -> RunFolderLock:
        path = self.run_dir / LOCK
        try:
            if self.fresh:  # (Hydra has made a new run's folder already; resume= names an existing one)
                self.run_dir.mkdir(parents=True, exist_ok=True)
            if found := foreign_files(self.run_dir):
                raise ValueError(f"{foreign_refusal(found)}. Nothing was started")
            self.fd = open_fd(path, os.O_RDWR | os.O_CREAT, 0o644)
        except ForeignFile as err:
            raise ValueError(f"{err}. Nothing was started") from None
        except OSError as err:
            raise ValueError(self._cannot_lock(path, err)) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another launcher"
            self._close()
            raise ValueError(
                f"{self.run_dir} is in use by a running job ({holder}): wait for it to end, stop it "
                f"(touch {self.run_dir / STOP}), or give another folder (hydra.run.dir=...)"
            ) from None
        except OSError as err:  # no flock here (some network file systems): refuse, not run unguarded
            self._close()
            raise ValueError(self._cannot_lock(path, err)) from None
        if self.fresh and (self.run_dir / CONFIG).exists():
            self._close()
            raise ValueError(
                f"{self.run_dir} already holds a run (its {CONFIG}): continue it with "
                f"resume={self.run_dir}, or give a fresh folder (leave hydra.run.dir out, or name a new one)"
            )
        write_holder(self.fd, "launcher pid")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close()

    @staticmethod
    def _cannot_lock(path: Path, err: OSError) -> str:
        """The refusal when ``path`` cannot be opened or locked (``err``): the file, why, and the fix."""
        fixes = {
            errno.EISDIR: f"remove that folder (rm -r {path}), or give another folder (hydra.run.dir=...)",
            errno.ENOENT: "give the folder of a run (e.g. resume=outputs/2026-01-31/12-00-00)",
            errno.ENOTDIR: "give the folder of a run (e.g. resume=outputs/2026-01-31/12-00-00)",
            errno.EACCES: f"make {path.parent} readable and writable for you",
            errno.EPERM: f"make {path.parent} readable and writable for you",
            errno.EROFS: "give a folder on a writable file system",
        }
        fix = fixes.get(err.errno or 0, "give a folder where the lock can be taken")
        return (
            f"cannot lock the run folder: {path}: {err.strerror or err}; {fix}. "
            "Nothing was started: without the lock two jobs could run in one folder at once"
        )

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def write_holder(fd: int, who: str) -> None:
    """Name the holder of the lock file ``fd`` in it (``who`` and this process's pid, host and time).

    The name is for a refused second taker's message."""
    holder = f"{who} {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder + "\n").encode(), 0)
    except OSError:  # a full disk: the lock holds all the same, without its holder's name
        pass
