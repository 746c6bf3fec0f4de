"""``hardware=cpu``: ranks on this machine's cores, started by mpirun."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from runner.hardware.base import HardwareConfig, Launch
from runner.hardware.cores import reserve as reserve_cores
from runner.hardware.mpirun import effective_bind, threads_per_rank
from runner.hardware.topology import format_cpulist


@dataclass
class CPUConfig(HardwareConfig):
    """This machine, CPU only (the defaults of :class:`HardwareConfig`).

    Jobs that run at once on the machine (a sweep's points in parallel, ``share`` of them) bind to
    disjoint cores: each gets 1/``share`` of the cores for its threads (unless ``threads_per_rank`` is
    set), and a job bound one rank per core holds its cores (:mod:`runner.hardware.cores`), taking the
    first free ones; when too few are free, it runs unbound and says so."""

    def plan_launch(self, ranks: int, run_dir: Path, reserve: bool = False, share: int = 1) -> Launch:
        cores = self.cores()
        if share > 1 and self.threads_per_rank is None:
            shared = replace(self, threads_per_rank=max(1, cores // share // ranks))
            return shared.plan_launch(ranks, run_dir, reserve)
        one_per_core = (
            effective_bind(self, ranks, cores) == "core" and threads_per_rank(self, ranks, cores) == 1
        )
        if not (reserve and one_per_core) or self.device == "cuda":  # GPUs: placed by their cores (gpu_plan)
            return super().plan_launch(ranks, run_dir)
        self.check_fits(ranks, cores)
        allowed = sorted(os.sched_getaffinity(0))
        lease = reserve_cores(ranks, allowed)
        if len(lease.cores) < ranks:
            held = sorted(set(allowed) - set(lease.cores))
            lease.release()
            launch = replace(self, bind="none").mpirun_launch(ranks, run_dir, cores)
            launch.warning = (
                f"cores {format_cpulist(held)} are held by other mpitrain jobs on this machine, leaving "
                f"fewer than the {ranks} this job binds to: it runs unbound, sharing cores; run fewer "
                "sweep points at once (e.g. hydra.launcher.n_jobs) or fewer devices per point"
            )
            return launch
        pe_list = None if lease.cores == allowed[:ranks] else lease.cores
        launch = self.mpirun_launch(ranks, run_dir, cores, pe_list=pe_list)
        launch.lease = lease
        return launch
