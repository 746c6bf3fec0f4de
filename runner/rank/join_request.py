"""A request to grow the job, ``RUN_DIR/JOIN``, as worker 0 reads it at the workers' agreement.

Its text must be a small number (ASCII digits, 1 to :data:`MOST_JOINED`; empty: 1), else it is named in one
warning and ignored (:func:`join_count`); a job that cannot grow (no fault tolerance, or collectives on NCCL
or gloo, whose groups cannot take new ranks) refuses it in one warning (:func:`growth_refusal`); either way
the file is removed and the job goes on. A JOIN older than the job (left by an earlier job of the run
folder) is removed unread (:func:`stale_join`). It is read as a regular file of the run folder, never
through a link and never blocking (:func:`read_join`): a named pipe there would hold worker 0, and with it
the job, until the stall watchdog ended it. The growth itself is :mod:`runner.rank.resilience.elastic`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from runner.folder_files import open_in_folder
from runner.run_folder import parse_number

if TYPE_CHECKING:
    from runner.comm.face import CommLike

#: The most workers one ``RUN_DIR/JOIN`` may ask for (``hardware.max_workers`` caps them further).
MOST_JOINED = 1000
#: The most of a JOIN file read (a request is a few bytes; a large file is not read whole).
JOIN_READ = 4096


def join_count(text: str) -> tuple[int, str | None]:
    """The workers a JOIN's ``text`` asks for (empty: 1), or 0 and why the text is not a request."""
    text = text.strip()
    if text == "":
        return 1, None
    count = parse_number(text.removeprefix("+"))  # (ASCII digits only, and few)
    if count is not None and 1 <= count <= MOST_JOINED:
        return count, None
    more = "+" if len(text) >= JOIN_READ - 1 else ""  # (only so much of the file was read)
    shown = ascii(text[:40]) + (f"... ({len(text)}{more} characters)" if len(text) > 40 else "")
    return 0, f"says {shown}: write the number of workers to add, 1 to {MOST_JOINED} (e.g. 2)"


def read_join(path: Path) -> str:
    """The text of ``RUN_DIR/JOIN`` (its first :data:`JOIN_READ` bytes), read at once.

    A link, a named pipe or anything but a regular file raises :class:`~runner.folder_files.ForeignFile`
    (an OSError naming it), and nothing blocks."""
    with open_in_folder(path, "rb") as file:
        return file.read(JOIN_READ).decode(errors="replace")


def growth_refusal(workers: CommLike) -> str | None:
    """Why the job of the workers' communicator ``workers`` cannot take new workers (None: it can).

    No fault tolerance (``hardware.fault_tolerance=none``), or its collectives on a ``torch.distributed``
    transport (NCCL, gloo), whose process groups cannot take new ranks (the spawn would wait forever)."""
    if not getattr(workers, "tolerant", False):
        return (
            "this job cannot grow (hardware.fault_tolerance=none); to add workers to a run, start it with "
            "hardware.fault_tolerance=continue or heal (and hardware.max_workers)"
        )
    dist = getattr(workers, "dist", None)
    if dist is not None:
        return (
            f"this job cannot grow: its collectives run on hardware.transport={dist.backend}, whose groups "
            "cannot take new workers; run it with hardware.transport=mpi (or auto on CPUs) to add workers"
        )
    return None


def stale_join(run_dir: Path, join: Path) -> bool:
    """Whether ``join`` was written before this job started (before the launcher wrote ``config.yaml``).

    Such a file is a request to an earlier job of the run folder, never to be applied to this one."""
    from runner.run_folder import CONFIG

    try:
        return join.stat().st_mtime < (run_dir / CONFIG).stat().st_mtime
    except OSError:
        return False
