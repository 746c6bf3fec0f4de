"""mpirun options given as they are (``hardware.extra_args``): checked by mpirun itself before launch.

An option mpirun does not know ends the job at once with status 213 and a box on its output, after the run
folder was written and without naming the key. :func:`check_extra_args` hands the options to
``mpirun ... --version`` first (Open MPI's mpirun parses its whole command line, then prints its version
and exits, starting nothing; a few milliseconds) and raises ValueError naming ``hardware.extra_args``, the
option and the fix. Values are not checked there (``--map-by bogus`` passes); PRRTE names those when the
job starts.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence

#: PRRTE's box for an option it does not know: "An unrecognized option ... Option: --bogus".
UNKNOWN = re.compile(r"unrecognized option.*?Option:\s*(\S+)", re.S | re.I)


def check_extra_args(mpirun: str, flavor: str, args: Sequence[str]) -> None:
    """Refuse ``hardware.extra_args`` that Open MPI's ``mpirun`` cannot parse, before anything starts."""
    if not args or flavor != "openmpi":
        return
    argv = [mpirun, *map(str, args), "--version"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return  # mpirun itself is checked (and named) where the job starts
    if done.returncode == 0:
        return
    output = f"{done.stdout}\n{done.stderr}"
    found = UNKNOWN.search(output)
    if found:
        raise ValueError(
            f"hardware.extra_args={list(args)}: mpirun does not know the option {found.group(1)!r} "
            f"(see {mpirun} --help); correct or remove it"
        )
    lines = [line.strip() for line in output.splitlines() if line.strip() and not line.startswith("---")]
    raise ValueError(
        f"hardware.extra_args={list(args)}: mpirun refused them (exit {done.returncode}): "
        + " ".join(lines[:4])
    )
