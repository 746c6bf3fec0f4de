"""How a sweep's points ended, and which errors that end a point before it starts are the user's input.

Shared by the launchers that run the points (this process's and Slurm's)."""

from __future__ import annotations

from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

#: The sweep points that did not end ok, as (name, status, exit status), in the order they ended.
NOT_OK: list[tuple[str, str, int]] = []
#: Sweep folders whose sweep was refused before any point started (in use by another sweep, a point's
#: config edited): the sweep report is not written into them.
REFUSED: set[Path] = set()


def os_error(err: BaseException | None) -> OSError | None:
    """The first OS error in ``err``'s chain (an unwritable or full output folder), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and not isinstance(err, HydraException):
            return err
        err = err.__cause__ or err.__context__
    return None


def invalid_input(err: BaseException | None) -> bool:
    """Whether ``err``, which made Hydra give up before or around the task, is the user's input.

    The user's input is a config that does not compose (unknown option, misspelt key, wrong type, bad override
    syntax) or a value refused. An OS error anywhere in its chain (an unwritable output folder) is not."""
    return os_error(err) is None and isinstance(err, (HydraException, OmegaConfBaseException, ValueError))


def one_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name when it has none).

    It is a point's reason in the manifest and the report."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
