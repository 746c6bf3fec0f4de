"""A fresh folder for the Open MPI session files of each mpirun the launcher starts, removed after the job.

Open MPI 5's mpirun (``prterun``) keeps its session files in ``$TMPDIR/ompi.<its pid>``. A killed mpirun
leaves that folder behind, and a later mpirun given the same pid (pids wrap at ``pid_max``, 32,768 by
default) then fails to start: its PMIx server finds its own rendezvous file already there, refuses it,
and prints only "The PMIx server's listener thread failed to start" (exit 213; the bundled PMIx does not
reclaim a dead process's file). Each job's mpirun therefore gets a folder of its own
(``prte_local_tmpdir_base``: mpirun's own machine; daemons elsewhere keep theirs), which the launcher
removes once the job has ended, however it ended. A folder the user chose (``PRTE_MCA_prte_tmpdir_base``
or ``PRTE_MCA_prte_local_tmpdir_base`` in the environment) is left as it is. Other MPIs ignore the
variable.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping

#: The PRRTE parameter, as an environment variable, that places mpirun's session folder on its machine.
LOCAL_TMPDIR_ENV = "PRTE_MCA_prte_local_tmpdir_base"
#: A user's own choice of the session folders' place: kept (PRRTE refuses both bases at once).
USER_TMPDIR_ENV = ("PRTE_MCA_prte_tmpdir_base", LOCAL_TMPDIR_ENV)
#: How the launcher's session folders are named in the temporary folder.
PREFIX = "mpitrain-mpi."


@contextlib.contextmanager
def session_dir(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """``env`` with mpirun's session folder set to a new folder, removed on leaving.

    Where ``env`` already places it: ``env`` as it is."""
    if any(key in env for key in USER_TMPDIR_ENV):
        yield dict(env)
        return
    folder = tempfile.mkdtemp(prefix=PREFIX)
    try:
        yield {**env, LOCAL_TMPDIR_ENV: folder}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
