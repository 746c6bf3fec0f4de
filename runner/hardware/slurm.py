"""Slurm: the allocation a job runs in, the ``srun`` command line, and the submitit sweep launcher.

``hardware=slurm`` runs inside an allocation: an ``sbatch`` script, ``salloc``, or a sweep sent to Slurm
with ``hydra/launcher=mpitrain_slurm``. The ranks are started with Open MPI's (or MPICH's) ``mpirun``,
which reads the allocation itself, or with ``srun --mpi=pmix``; ``hardware.launcher=auto`` takes ``srun``
inside a job step, where ``mpirun`` cannot work (it starts its daemons through ``srun``), and ``mpirun``
otherwise.

``hydra/launcher=mpitrain_slurm`` is hydra-submitit-launcher's ``submitit_slurm`` with the job's Python
run directly in the batch script (``use_srun: false``), so each sweep point is one allocation whose
single launcher starts the ranks, and with ``tasks_per_node`` defaulting to ``devices`` / ``nodes``
(rounded up), so the allocation has a slot for every worker (add one per server rank for async EASGD and
ASGD). Its launcher (:mod:`runner.launcher.slurm_sweep`) takes each point's result from that single task,
and reads the jobs' states from ``sacct``, or from ``squeue`` where Slurm keeps no accounting (no slurmdbd).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runner.hardware.base import HardwareConfig, Launch
from runner.hardware.mpirun import effective_bind, rank_env, srun_mca_env, threads_per_rank, worker_argv
from runner.schema import one_of, require

#: Step ids from here up are Slurm's special steps (batch script, extern, interactive), not ``srun`` steps.
BATCH_STEP = 0xFFFFFFF0

#: hardware.bind -> srun's --cpu-bind
CPU_BIND = {"core": "cores", "socket": "sockets", "numa": "ldoms", "none": "none"}


def expand_counts(text: str) -> list[int]:
    """Slurm's compressed per-node counts: ``"4(x2),2"`` → ``[4, 4, 2]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"cannot read the Slurm count list {text!r} (expected e.g. '4(x2),2')")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


@dataclass
class SlurmConfig(HardwareConfig):
    """Inside a Slurm allocation; ``launcher``: auto (srun inside a job step, else mpirun) | mpirun | srun."""

    launcher: str = "auto"
    srun_mpi: str = "pmix"

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("launcher", self.launcher, ("auto", "mpirun", "srun"))
        require(
            bool(self.srun_mpi),
            "srun_mpi",
            self.srun_mpi,
            "an srun --mpi plugin, e.g. pmix (see srun --mpi=list)",
        )

    @property
    def one_machine(self) -> bool:
        return False

    def plan_launch(self, ranks: int, run_dir: Path, reserve: bool = False, share: int = 1) -> Launch:
        """The job in this allocation: ``mpirun`` (which reads the nodes from Slurm) or ``srun``.

        It has ``SLURM_CPUS_PER_TASK`` threads per rank unless ``threads_per_rank`` says otherwise; refused
        when the allocation cannot hold it. GPUs are planned only on a single node started by mpirun."""
        alloc = require_allocation()
        launcher = choose_launcher(self.launcher, alloc)
        hw = replace(self, threads_per_rank=self.threads_per_rank or alloc.cpus_per_task)
        threads, bind = threads_per_rank(hw, ranks, alloc.cpus), effective_bind(hw, ranks, alloc.cpus)
        if not self.oversubscribe:
            check_fits(alloc, launcher, ranks, threads)
        if launcher == "srun" and self.tolerant:
            raise ValueError(
                f"hardware.fault_tolerance={self.fault_tolerance} needs mpirun: under srun, Slurm's PMIx "
                "server (slurmstepd's mpi/pmix plugin) kills the whole job step at the first lost rank, so "
                "ULFM cannot go on; set hardware.launcher=mpirun (or auto, from the batch script, outside "
                "a job step), or hardware.fault_tolerance=none"
            )
        if launcher == "srun" and self.grows:
            raise ValueError(
                "hardware.fault_tolerance=heal and hardware.max_workers need mpirun, which can start "
                "processes into a running job (MPI_Comm_spawn); srun cannot: set hardware.launcher=mpirun "
                "(from the batch script, outside a job step), or hardware.fault_tolerance=continue"
            )
        if launcher == "srun":
            env = rank_env(hw, threads)
            env.update((k, v) for k, v in srun_mca_env(hw).items() if k not in env)  # hardware.env wins
            shown = {k: v for k, v in env.items() if k not in hw.env}  # hardware.env: srun exports it
            argv = srun_argv(hw, ranks, threads, bind, shown, alloc, worker_argv(run_dir))
            return Launch(argv, threads, bind, "srun", env=dict(hw.env))
        placements = hw.gpu_plan(ranks, threads) if alloc.nodes == 1 else None
        return hw.mpirun_launch(ranks, run_dir, alloc.cpus, placements)


@dataclass
class Allocation:
    """The Slurm allocation this process runs in, from the ``SLURM_*`` environment."""

    job_id: str
    nodes: int
    tasks: int
    cpus: int
    cpus_per_task: int | None
    gpus: bool
    in_step: bool

    @property
    def where(self) -> str:
        return f"Slurm job {self.job_id}: {self.nodes} node(s), {self.tasks} task(s), {self.cpus} CPUs"


def allocation(environ: Mapping[str, str] = os.environ) -> Allocation | None:
    """The current allocation, or None outside Slurm.

    Tasks come from ``SLURM_NTASKS`` (else ``SLURM_TASKS_PER_NODE``), CPUs from
    ``SLURM_JOB_CPUS_PER_NODE`` over all nodes; ``SLURM_STEP_ID`` marks a process inside a job step
    started by ``srun`` (the batch script's own step does not count).
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    cpus = expand_counts(environ.get("SLURM_JOB_CPUS_PER_NODE", environ.get("SLURM_CPUS_ON_NODE", "1")))
    if "SLURM_NTASKS" in environ:
        tasks = int(environ["SLURM_NTASKS"])
    elif environ.get("SLURM_TASKS_PER_NODE"):
        tasks = sum(expand_counts(environ["SLURM_TASKS_PER_NODE"]))
    else:
        tasks = len(cpus)
    nodes = int(environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES", len(cpus))))
    if len(cpus) == 1 and nodes > 1:
        cpus = cpus * nodes
    cpus_per_task = environ.get("SLURM_CPUS_PER_TASK")
    return Allocation(
        job_id=job_id,
        nodes=nodes,
        tasks=tasks,
        cpus=sum(cpus),
        cpus_per_task=int(cpus_per_task) if cpus_per_task else None,
        gpus=bool(environ.get("SLURM_GPUS_ON_NODE") or environ.get("SLURM_JOB_GPUS")),
        in_step=int(environ.get("SLURM_STEP_ID", BATCH_STEP)) < BATCH_STEP,
    )


def require_allocation(environ: Mapping[str, str] = os.environ) -> Allocation:
    alloc = allocation(environ)
    if alloc is None:
        raise ValueError(
            "hardware=slurm runs inside a Slurm allocation, but SLURM_JOB_ID is not set: start it from an "
            "sbatch script or salloc, or send a sweep with hydra/launcher=mpitrain_slurm; outside Slurm "
            "use hardware=cpu, hardware=gpu or hardware=cluster"
        )
    return alloc


def choose_launcher(launcher: str, alloc: Allocation) -> str:
    """``mpirun`` or ``srun`` for ``hardware.launcher`` (auto | mpirun | srun) in ``alloc``."""
    if launcher == "auto":
        return "srun" if alloc.in_step else "mpirun"
    if launcher == "mpirun" and alloc.in_step:
        raise ValueError(
            "hardware.launcher=mpirun cannot start ranks from inside a Slurm job step (this process was "
            "started by srun, and mpirun launches through srun itself); use hardware.launcher=srun or auto"
        )
    return launcher


def check_fits(alloc: Allocation, launcher: str, ranks: int, threads: int) -> None:
    """Refuse a job that the allocation cannot hold (SlurmConfig would queue the step forever or fail late).

    Not called with ``hardware.oversubscribe=true``."""
    if launcher == "mpirun" and ranks > alloc.tasks:
        raise ValueError(
            f"devices: the job needs {ranks} ranks but {alloc.where} (SLURM_NTASKS); ask for more tasks "
            f"(sbatch --ntasks={ranks}, or hydra.launcher.tasks_per_node with "
            "hydra/launcher=mpitrain_slurm), lower devices, or set hardware.oversubscribe=true"
        )
    if ranks * threads > alloc.cpus:
        raise ValueError(
            f"hardware.threads_per_rank: {ranks} ranks x {threads} threads need {ranks * threads} CPUs but "
            f"{alloc.where}; ask for more CPUs (sbatch --cpus-per-task), set hardware.threads_per_rank, or "
            "hardware.oversubscribe=true"
        )


def srun_argv(
    hw: SlurmConfig,
    ranks: int,
    threads: int,
    bind: str,
    env: Mapping[str, str],
    alloc: Allocation,
    worker: list[str],
) -> list[str]:
    """``srun --mpi=<plugin>`` starting ``ranks`` ranks of ``threads`` CPUs each, bound by ``bind``.

    A failed task ends the step (fault tolerance is refused under srun: :meth:`SlurmConfig.plan_launch`);
    ``--overlap`` lets the step share CPUs with the step this process runs in, if any (else it would wait
    for them forever); the environment goes through ``env`` so ``mpirun.txt`` replays the run exactly.
    """
    argv = ["srun", f"--mpi={hw.srun_mpi}", f"--ntasks={ranks}", f"--cpus-per-task={threads}"]
    argv += [f"--cpu-bind={CPU_BIND[bind]}", "--kill-on-bad-exit=1", "--unbuffered"]
    if alloc.in_step:
        argv.append("--overlap")
    if hw.oversubscribe:
        argv.append("--overcommit")
    if hw.device == "cuda" and alloc.gpus:
        argv += ["--gpus-per-task=1", "--gpu-bind=closest"]
    argv += list(hw.extra_args)
    return argv + ["env", *(f"{k}={v}" for k, v in env.items()), *worker]


#: The name Hydra knows ``hydra/launcher=mpitrain_slurm``'s launcher by (it takes launchers only from the
#: ``hydra_plugins`` package); the class is :class:`runner.launcher.slurm_sweep.MpitrainSlurmLauncher`.
SLURM_LAUNCHER = "hydra_plugins.mpitrain_slurm.MpitrainSlurmLauncher"

try:
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
except ImportError:  # the optional `slurm` extra is not installed
    SlurmQueueConf = None

if SlurmQueueConf is not None:

    @dataclass
    class SubmititSlurmConf(SlurmQueueConf):
        """``hydra/launcher=mpitrain_slurm``: one allocation per sweep point, whose launcher starts ranks.

        Each point's result is read from the task that ran it (:mod:`runner.launcher.slurm_sweep`)."""

        _target_: str = SLURM_LAUNCHER
        use_srun: bool = False
        tasks_per_node: Any = "${mpitrain_ceil_div:${devices},${hydra.launcher.nodes}}"
        name: str = "mpitrain"


def register_launcher() -> None:
    """Store ``hydra/launcher=mpitrain_slurm`` when hydra-submitit-launcher is installed.

    Its launcher, :data:`SLURM_LAUNCHER`, is made known to Hydra by ``runner.launcher.register``."""
    if SlurmQueueConf is None:
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("mpitrain_ceil_div", lambda a, b: -(-int(a) // int(b)), replace=True)
    ConfigStore.instance().store(
        group="hydra/launcher", name="mpitrain_slurm", node=SubmititSlurmConf, provider="mpitrain"
    )
