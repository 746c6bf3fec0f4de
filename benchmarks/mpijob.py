"""Start a benchmark script again under mpirun, one rank per core, for the benchmarks that time MPI calls.

if in_mpirun():
    bench(args)
else:
    sys.exit(relaunch(__file__, args.ranks))
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def in_mpirun() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def relaunch(script: str, ranks: int, mca: dict[str, str] | None = None) -> int:
    """Run ``script`` with this process's arguments on ``ranks`` ranks bound to cores (oversubscribed when
    there are fewer), one torch thread each, ``BENCH_PORT`` a free TCP port for torch.distributed; returns
    mpirun's exit status."""
    sys.path.insert(0, str(ROOT))
    from runner.hardware.mpirun import find_mpirun

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [find_mpirun(None), "-n", str(ranks), "--bind-to"]
    argv.append("core" if ranks <= len(os.sched_getaffinity(0)) else "none")
    if ranks > len(os.sched_getaffinity(0)):
        argv.append("--oversubscribe")
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    for key, value in (mca or {}).items():
        argv += ["--mca", key, value]
    argv += ["-x", f"BENCH_PORT={port}", "-x", "OMP_NUM_THREADS=1", "-x", f"PYTHONPATH={ROOT}"]
    argv += [sys.executable, "-m", "mpi4py", script, *sys.argv[1:]]
    return subprocess.call(argv)


def leave() -> None:
    """End a rank of the benchmark's job once its work is done: output flushed, MPI finalized, then out
    without the interpreter's teardown, where a thread of torch.distributed's gloo group was seen to abort
    the process ("terminate called without an active exception") after every result was printed."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(0)
