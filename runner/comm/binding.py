"""The one import of mpi4py: MPI's Python binding, loaded without starting MPI.

Importing this module starts no MPI (data-loader processes that import the layer never do): a rank's worker
calls :func:`runner.comm.mpi.init`, which also arranges the finalization. Every other module of the layer
takes ``MPI`` from here, so the settings below always come first.
"""

from __future__ import annotations

import mpi4py

mpi4py.rc.initialize = False  # importing MPI starts nothing: init() does
mpi4py.rc.finalize = False  # init() registers the finalization

from mpi4py import MPI  # noqa: E402

#: The reductions of each ``op`` name the layer accepts.
OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG


def versions() -> dict[str, str]:
    """The versions of mpi4py and of the MPI library this process runs with."""
    library = MPI.Get_library_version().replace("\0", "").strip()  # Open MPI's ends with a NUL
    return {"mpi4py": mpi4py.__version__, "mpi": library.splitlines()[0]}
