"""Worker side of the placement: each rank fits its threads to its CPU affinity and takes its GPU.

Rank 0 checks every rank's binding against ``hardware.bind`` and the launcher's ``plan.json``.

torch is imported inside the functions: the launcher imports this package and must not import torch.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from runner.folder_files import read_text
from runner.hardware.topology import Topology, gpu_slots, read_topology
from runner.run_folder import BINDINGS, PLAN, write_atomic

if TYPE_CHECKING:
    import torch

    from runner.hardware.base import HardwareConfig


class RankComm(Protocol):
    """What placement needs of the worker's communicator (``runner.comm.Comm``)."""

    rank: int
    size: int

    def local_rank(self) -> int: ...

    def local_size(self) -> int: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...


def bind_threads(hw: HardwareConfig, rank: int, topo: Topology) -> dict[str, Any]:
    """Read this rank's CPU affinity, set torch's thread count to fit it, and say where the rank runs."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    threads = hw.threads_per_rank or 1
    if len(cores) < (os.cpu_count() or len(cores)):
        threads = min(threads, len(cores))
    torch.set_num_threads(threads)
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cores": cores,
        "numa": sorted({topo.numa_of(c) for c in cores}),
        "threads": threads,
    }


def check_bindings(bindings: list[dict[str, Any]], bind: str, plan: list[dict[str, Any]] | None) -> list[str]:
    """Problems with the ranks' placement.

    Ranks of one host sharing a core although binding was asked, or a rank outside the NUMA node the plan
    put it on (that of its GPU)."""
    if bind == "none":
        return []
    problems, seen = [], {}
    for b in bindings:
        for core in b["cores"]:
            other = seen.setdefault((b["host"], core), b["rank"])
            if other != b["rank"]:
                where = f"core {core} on {b['host']}"
                problems.append(f"ranks {other} and {b['rank']} share {where} although hardware.bind={bind}")
                break
    for b, p in zip(bindings, plan or [], strict=False):
        if b["numa"] != [p["numa"]]:
            problems.append(
                f"rank {b['rank']} runs on NUMA node(s) {b['numa']}, planned: {p['numa']} (GPU {p['gpu']})"
            )
    return problems


def read_plan(run_dir: Path) -> list[dict[str, Any]] | None:
    """The launcher's ``plan.json`` (each rank's NUMA node, cores and GPU), or None when it made none."""
    try:
        return json.loads(read_text(run_dir / PLAN))  # (never through a link)
    except FileNotFoundError:
        return None


def select_device(hw: HardwareConfig, comm: RankComm, run_dir: Path) -> torch.device:
    """CPU, or this rank's GPU: the one ``plan.json`` gives it, else its local rank's.

    Its local rank's on nodes the launcher could not plan (other hosts, srun), by the plan's rule for
    sharing GPUs."""
    import torch

    if hw.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("hardware.device=cuda but torch sees no CUDA device; use hardware=cpu")
    plan = read_plan(run_dir)
    if plan is not None:
        index = plan[comm.rank]["gpu"]
    else:
        gpus = min(torch.cuda.device_count(), hw.gpus_per_node or torch.cuda.device_count())
        slots = gpu_slots(comm.local_size(), gpus, hw.ranks_per_gpu, platform.node())
        index = slots[comm.local_rank()]
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def place_rank(hw: HardwareConfig, comm: RankComm, run_dir: Path) -> tuple[torch.device, dict[str, Any]]:
    """Fit torch's threads to this rank's affinity, pick its device, and report where every rank runs.

    Collective: every rank calls it. Each prints ``rank r/N on HOST, cores ..., T threads[, GPU g]``; rank 0
    checks all bindings (:func:`check_bindings`), prints the problems as warnings and writes
    ``bindings.json`` (``ranks``, ``plan``, ``problems``). Returns the device and this rank's binding.
    """
    binding = bind_threads(hw, comm.rank, read_topology())
    device = select_device(hw, comm, run_dir)
    binding["gpu"] = device.index if device.type == "cuda" else None
    bindings = comm.allgather_object(binding)
    where = (
        f"{binding['host']}, cores {binding['cores']} (NUMA {binding['numa']}), {binding['threads']} threads"
    )
    gpu = f", GPU {binding['gpu']}" if binding["gpu"] is not None else ""
    print(f"rank {comm.rank}/{comm.size} on {where}{gpu}")
    if comm.rank == 0:
        plan = read_plan(run_dir)
        problems = check_bindings(bindings, hw.bind, plan)
        for problem in problems:
            print(f"warning: {problem}", file=sys.stderr)
        report = {"ranks": bindings, "plan": plan, "problems": problems}
        write_atomic(run_dir / BINDINGS, json.dumps(report, indent=1))
    return device, binding


#: The environment variable with which NCCL 2.30 and later take several ranks on one GPU (experimental).
SHARE_GPUS = "NCCL_MULTI_RANK_GPU_ENABLE"


def choose_transport(hw: HardwareConfig, workers: RankComm, device: torch.device) -> tuple[str, str | None]:
    """Collective over the workers: the transport of their tensor collectives (``mpi``, ``nccl`` or ``gloo``).

    Returned with why ``auto`` did not take NCCL on GPUs (None when it did, or asked nothing of it).

    ``auto`` takes NCCL when the device is a GPU, torch has NCCL, and every worker has its own GPU, or
    several share one and the NCCL in use allows it (2.30 and later, with ``NCCL_MULTI_RANK_GPU_ENABLE=1``);
    otherwise MPI, staged through host memory. An explicit ``nccl`` that cannot run raises ValueError
    naming the fix.
    """
    import torch

    from runner.comm.dist import nccl_version

    if hw.transport in ("mpi", "gloo") or (hw.transport == "auto" and device.type != "cuda"):
        return ("mpi" if hw.transport == "auto" else hw.transport), None
    if hw.grows:
        return "mpi", "a job that grows keeps its collectives on MPI"  # (explicit nccl: refused at launch)
    gpus = workers.allgather_object((platform.node(), str(torch.cuda.get_device_properties(device).uuid)))
    version = nccl_version()
    why = None
    if version is None or not torch.distributed.is_nccl_available():
        why = "this torch has no NCCL"
    elif len(set(gpus)) < len(gpus) and not (nccl_shares_gpus(version) and os.environ.get(SHARE_GPUS) == "1"):
        why = (
            f"workers share a GPU and NCCL {version} takes one rank per GPU unless it is 2.30 or later "
            f"and {SHARE_GPUS}=1 (+hardware.env.{SHARE_GPUS}=1)"
        )
    if why is not None and hw.transport == "nccl":
        raise ValueError(f"hardware.transport=nccl: {why}; or set hardware.transport=mpi (or auto)")
    return ("mpi", why) if why is not None else ("nccl", None)


def nccl_shares_gpus(version: str) -> bool:
    """Whether NCCL ``version`` can take several ranks on one GPU (2.30 and later, with ``SHARE_GPUS=1``)."""
    major, minor = (int(v) for v in version.split(".")[:2])
    return (major, minor) >= (2, 30)
