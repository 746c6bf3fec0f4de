"""A run folder's files opened as what they are: regular files of the folder, never through a link.

A run folder may come from elsewhere (``resume=`` of a folder another user or machine wrote), and a file in
it may be planted: ``job.lock`` or ``metrics.jsonl`` as a symbolic link to a file of the user's would have
the runner truncate and write that file; ``JOIN`` as a named pipe would block the rank that reads it. So
every file the runner reads or writes in a run folder is opened by :func:`open_in_folder` (or
:func:`open_fd`): never through a symbolic link (``O_NOFOLLOW``), never blocking on a pipe
(``O_NONBLOCK``), and only once it is known to be a regular file is a byte read, written or truncated.
Anything else is refused with :class:`ForeignFile`, an OSError naming the file, what it is, and the fix.
Temporary files are created exclusively (:func:`create_new`); the folders inside a run folder are made by
:func:`make_folder`, which refuses a link in their place. The launcher checks a whole folder before it
takes it (:func:`runner.run_folder.foreign_files`), so ``resume=`` of a folder holding a link refuses it
before anything starts (exit 2). This module imports nothing of the runner, neither torch nor MPI.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path
from typing import IO, Any

#: The fix a refusal ends with.
FIX = "a run folder's files are its own; remove {}"
#: How a mode of :func:`open` opens a file here (``O_TRUNC`` is applied only once the file is checked).
FLAGS = {
    "r": os.O_RDONLY,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}
#: The kinds of file that are not a run folder's own, by ``stat``'s test.
KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
)


class ForeignFile(OSError):
    """A file of a run folder that is not its own regular file: a symbolic link, a pipe, a device."""

    def __init__(self, path: Path, what: str):
        super().__init__(errno.ELOOP, f"{path} is {what}: {FIX.format('it')}")
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple:
        return _foreign, (self.path, str(self.strerror))


def _foreign(path: Path, message: str) -> ForeignFile:
    err = ForeignFile.__new__(ForeignFile)
    OSError.__init__(err, errno.ELOOP, message)
    err.path = path
    return err


def describe(path: Path, mode: int) -> str:
    """What the file ``path`` of ``stat`` mode ``mode`` is, when it is not a regular file.

    For example ``a symbolic link (to X)``, ``a named pipe (FIFO), not a regular file``."""
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    kind = next((name for test, name in KINDS if test(mode)), "not a regular file")
    return f"{kind}, not a regular file"


def refused(path: Path, mode: int | None = None) -> ForeignFile:
    """The refusal of ``path`` (its ``stat`` mode ``mode``; None: looked up, without following it)."""
    if mode is None:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = 0
    return ForeignFile(path, describe(path, mode))


def open_fd(path: Path, flags: int, perm: int = 0o666) -> int:
    """``os.open(path, flags, perm)`` of a run folder's file, which must be a regular file (or be made one).

    A symbolic link, pipe, socket or device there raises :class:`ForeignFile`, a folder read raises
    IsADirectoryError; ``O_TRUNC`` truncates only once the file is checked."""
    truncate = flags & os.O_TRUNC
    flags = (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG  # (made by the open, or missing: the open says which)
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # refused unopened: opening a device may act
        raise refused(path, mode)
    try:
        fd = os.open(path, flags, perm)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO):  # a link or a pipe put there since the lstat
            raise refused(path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise refused(path, mode)
        os.set_blocking(fd, True)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_in_folder(path: Path, mode: str = "r", perm: int = 0o666, **kwargs: Any) -> IO[Any]:
    """:func:`open` of a run folder's file, checked by :func:`open_fd`.

    ``mode``: ``r``, ``w``, ``a`` or ``x``, with ``b`` for bytes; ``kwargs`` go to :func:`os.fdopen`
    (``buffering``, ``errors``)."""
    fd = open_fd(path, FLAGS[mode.replace("b", "").replace("t", "")], perm)
    try:
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_text(path: Path, errors: str = "strict") -> str:
    """The text of a run folder's file (:func:`open_in_folder`)."""
    with open_in_folder(path, "r", errors=errors) as file:
        return file.read()


def read_bytes(path: Path, limit: int = -1) -> bytes:
    """The bytes of a run folder's file, at most ``limit`` of them (-1: all)."""
    with open_in_folder(path, "rb") as file:
        return file.read(limit)


def write_text(path: Path, text: str) -> None:
    """Write a run folder's file in place (``write_atomic`` in :mod:`runner.run_folder` replaces it whole)."""
    with open_in_folder(path, "w") as file:
        file.write(text)


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not through a link)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def create_new(path: Path, binary: bool = False) -> IO[Any]:
    """A new file at ``path`` (a temporary one, replaced into place afterwards), created exclusively.

    A file left there (by a writer that was killed) or a link put in its place is removed first, never written
    through; a folder there raises IsADirectoryError."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except FileExistsError:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path)) from None
        os.unlink(path)  # (a link itself, not what it points to)
        fd = os.open(path, flags, 0o666)
    return os.fdopen(fd, "wb" if binary else "w")


def make_folder(path: Path) -> Path:
    """Make ``path``, a folder inside a run folder, unless it is there.

    ``path``: ``logs/``, ``checkpoints/``, a checkpoint's. A link or special file in its place raises
    :class:`ForeignFile` (a regular file: FileExistsError, as ``mkdir`` does)."""
    try:
        path.mkdir()
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if stat.S_ISREG(mode):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
    if not stat.S_ISDIR(mode):
        raise refused(path, mode)
    return path


def foreign_refusal(found: list[str]) -> str:
    """The one line refusing a run folder with the ``found`` files in it.

    The files are those :func:`runner.run_folder.foreign_files` found."""
    return f"{', '.join(found)}: {FIX.format('them' if len(found) > 1 else 'it')}"


#: The fix for an OS error met writing in a folder, by its errno: the disk's fault, not the input's.
DISK_FIXES = {
    errno.ENOSPC: "free space on its disk (df -h {folder})",
    errno.EDQUOT: "free space within your quota (quota -s)",
    errno.EROFS: "its file system is read-only: remount it writable",
}


def disk_fix(err: OSError, folder: Path | str, key: str | None = None) -> str | None:
    """The fix for ``err``, met writing in ``folder`` (a full disk, a quota, a read-only file system).

    ``key`` (``hydra.run.dir``), where given, names the other fix: another folder. None for other errors."""
    fix = DISK_FIXES.get(err.errno or 0)
    if fix is None:
        return None
    return fix.format(folder=folder) + (f", or give a folder on another disk ({key}=...)" if key else "")


def unwritten(err: OSError, key: str | None = None) -> str | None:
    """One line for ``err`` when it is the disk's (:func:`disk_fix`) and its file is known; None otherwise.

    The file is named by the error, else found by :func:`failed_file`. The line gives the file, why, and the
    fix, e.g. ``cannot write RUN/.hydra/config.yaml: No space left on device; free space on its disk (df -h
    RUN/.hydra), or give a folder on another disk (hydra.run.dir=...)``."""
    path = Path(err.filename) if isinstance(err.filename, str) else failed_file(err)
    fix = None if path is None else disk_fix(err, path if path.is_dir() else path.parent, key)
    return None if fix is None else f"cannot write {path}: {err.strerror or err}; {fix}"


def failed_file(err: BaseException) -> Path | None:
    """The file ``err`` was met writing when the error does not name it.

    It is the file object open in the innermost frame of ``err``'s traceback that holds one. A write to a full
    disk fails as the file is flushed, on closing it: Hydra's own write of ``.hydra/config.yaml`` says only
    "No space left on device"."""
    found, tb = None, err.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                found = Path(value.name)
        tb = tb.tb_next
    return found


def dangling_link(key: str, value: str) -> str | None:
    """The line for ``key=value`` (``hydra.run.dir=PATH``) when PATH or a folder above it is a dangling link.

    A symbolic link to nothing, of which ``mkdir`` says only "File exists". The line gives the key, the link,
    its target and the fixes; None when no link on the way is dangling."""
    path = Path(value).expanduser()
    for link in (path, *path.parents):
        try:
            if not stat.S_ISLNK(os.lstat(link).st_mode) or link.exists():
                continue
            target = os.readlink(link)
        except OSError:  # (not there, or a name too long to look at)
            continue
        return (
            f"{key}={value}: {link} is a symbolic link to {target}, which does not exist: make that "
            f"folder (mkdir -p {link.parent / target}), remove the link (rm {link}), or give another "
            f"folder ({key}=...)"
        )
    return None
