"""mpirun options given as they are (``hardware.extra_args``): checked by mpirun itself before launch.

An option mpirun does not know ends the job at once with status 213 and a box on its output, after the run
folder was written and without naming the key. :func:`check_extra_args` hands the options to
``mpirun ... --version`` first, as the job would give them (with ``--allow-run-as-root`` where the job runs
as root, as :func:`runner.hardware.mpirun.build_argv` adds it): Open MPI's mpirun parses its whole command
line, then prints its version and exits, starting nothing; a few milliseconds. What mpirun said is raised
as ValueError naming ``hardware.extra_args`` and the fix. Values are not checked there (``--map-by bogus``
passes); PRRTE names those when the job starts.

mpirun takes the first word that is not one of its options as the program to run, and the rest as that
program's arguments: a word of the extra arguments that is no option (nor an option's value) would be run
in place of the ranks. Here it gets ``--version``: mpirun says it cannot find a program of that name, or
(a program found) runs ``PROGRAM --version`` instead of printing its own version, which is refused too.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence

#: PRRTE's box for an option it does not know: "An unrecognized option ... Option: --bogus".
UNKNOWN = re.compile(r"unrecognized option.*?Option:\s*(\S+)", re.S | re.I)
#: PRRTE's box for a program it cannot find: "... unable to find the specified executable ... Executable: x".
NO_PROGRAM = re.compile(r"Executable:\s*(\S+)")
#: What mpirun prints for ``--version``: "mpirun (Open MPI) 5.0.11" (as :func:`.mpirun.mpi_flavor` tells it).
VERSION = re.compile(r"open[ -]mpi|openrte", re.I)
#: The fix for a word taken as the program to run.
POSITIONAL_FIX = (
    "mpirun takes the first word that is not one of its options as the program to run: give only options "
    "and their values (hardware.extra_args=[--display-map,--map-by,core]), or remove it"
)


def check_argv(mpirun: str, args: Sequence[str]) -> list[str]:
    """The command line that checks ``args``: mpirun's, with ``--version`` in place of the program.

    It is mpirun's as the job's would start (root allowed where the job runs as root)."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *root, *map(str, args), "--version"]


def check_extra_args(mpirun: str, flavor: str, args: Sequence[str]) -> None:
    """Refuse ``hardware.extra_args`` that Open MPI's ``mpirun`` cannot parse, before anything starts."""
    if not args or flavor != "openmpi":
        return
    try:
        done = subprocess.run(check_argv(mpirun, args), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return  # mpirun itself is checked (and named) where the job starts
    output = f"{done.stdout}\n{done.stderr}"
    if done.returncode == 0 and VERSION.search(output):
        return
    given = f"hardware.extra_args={list(args)}"
    if found := UNKNOWN.search(output):
        raise ValueError(
            f"{given}: mpirun does not know the option {found.group(1)!r} (see {mpirun} --help); correct or "
            "remove it"
        )
    said = first_paragraph(done.stderr) or first_paragraph(done.stdout)  # (stdout: --display-map's map)
    if done.returncode == 0:  # a word of them was run with --version instead of mpirun printing its own
        printed = [line.strip() for line in done.stdout.splitlines() if line.strip()][-1:]
        raise ValueError(
            f"{given}: mpirun ran a word of them as the program, with --version (it printed "
            f"{' '.join(printed)!r}), instead of printing its own version; {POSITIONAL_FIX}"
        )
    if found := NO_PROGRAM.search(output):
        raise ValueError(
            f"{given}: mpirun took {found.group(1)!r} as the program to run (mpirun said: {said!r}); "
            + POSITIONAL_FIX
        )
    raise ValueError(
        f"{given}: mpirun refused them (exit {done.returncode}; mpirun said: {said!r}); correct or remove "
        "them"
    )


def first_paragraph(output: str) -> str:
    """The first paragraph of ``output``, in one line: what mpirun says first is what went wrong.

    The paragraph is ``output``'s lines up to a blank one, its boxes' rules left out, with the next one where
    it ends in a colon ("Directive: x")."""
    paragraphs: list[list[str]] = [[]]
    for line in output.splitlines():
        if line.strip().startswith("---"):
            continue
        if line.strip():
            paragraphs[-1].append(line.strip())
        elif paragraphs[-1]:
            paragraphs.append([])
    first = " ".join(paragraphs[0])
    if first.endswith(":") and len(paragraphs) > 1:
        first += " " + " ".join(paragraphs[1])
    return " ".join(first.split())
