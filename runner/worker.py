"""The worker entry point, one process per rank: ``python -m mpi4py -m runner.worker RUN_DIR``.

It reads the resolved config the launcher wrote into RUN_DIR (Hydra does not run here), sends its output to
``RUN_DIR/logs/rank<r>.log`` (rank 0 also to the terminal), checks and records where it is bound, builds
model, optimizer, data and rule with ``hydra.utils.instantiate`` and trains. An exception is written to
``RUN_DIR/logs/rank<r>.error`` and re-raised, so ``mpi4py``'s runner aborts the whole job.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from runner.comm import OWNER_ENV, Comm, mpi_library_version
from runner.loop import Trainer, broadcast_state
from runner.metrics import MetricsLog
from runner.topology import Topology, gpu_slots, read_topology


class Tee:
    """A text stream that writes to several streams."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False


def redirect_output(run_dir: Path, rank: int) -> tuple[TextIO, TextIO]:
    """Send this rank's stdout/stderr to its log file (rank 0: and to the terminal).

    Returns ``(log, terminal)``: the log file, and the terminal stream for rank 0's progress bar.
    """
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    log = open(logs / f"rank{rank}.log", "a", buffering=1)
    terminal = sys.stdout
    if rank == 0:
        sys.stdout, sys.stderr = Tee(log, sys.stdout), Tee(log, sys.stderr)
    else:
        sys.stdout = sys.stderr = log
    return log, terminal


def versions() -> dict[str, Any]:
    import mpi4py
    import numpy

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi": mpi_library_version(),
        "cuda": torch.version.cuda or "none",
    }


def bind_threads(cfg: DictConfig, comm: Comm, topo: Topology) -> dict[str, Any]:
    """Read this rank's CPU affinity, set torch's thread count to fit it, and say where the rank runs."""
    cores = sorted(os.sched_getaffinity(0))
    threads = cfg.hardware.threads_per_rank or 1
    if len(cores) < (os.cpu_count() or len(cores)):
        threads = min(threads, len(cores))
    torch.set_num_threads(threads)
    return {
        "rank": comm.rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cores": cores,
        "numa": sorted({topo.numa_of(c) for c in cores}),
        "threads": threads,
    }


def check_bindings(bindings: list[dict[str, Any]], bind: str, plan: list[dict[str, Any]] | None) -> list[str]:
    """Problems with the ranks' placement: ranks of one host sharing a core although binding was asked, or
    a rank outside the NUMA node the plan put it on (that of its GPU)."""
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


def select_device(cfg: DictConfig, comm: Comm, run_dir: Path) -> torch.device:
    """CPU, or this rank's GPU: the one ``plan.json`` gives it, else its local rank's (nodes the launcher
    could not plan: other hosts, srun), by the plan's rule for sharing GPUs."""
    if cfg.hardware.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("hardware.device=cuda but torch sees no CUDA device; use hardware=cpu")
    plan_file = run_dir / "plan.json"
    if plan_file.exists():
        index = json.loads(plan_file.read_text())[comm.rank]["gpu"]
    else:
        gpus = min(torch.cuda.device_count(), cfg.hardware.gpus_per_node or torch.cuda.device_count())
        slots = gpu_slots(comm.local_size(), gpus, cfg.hardware.ranks_per_gpu, platform.node())
        index = slots[comm.local_rank()]
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def run(
    cfg: DictConfig, run_dir: Path, comm: Comm, log_file: TextIO, terminal: TextIO
) -> dict[str, Any] | None:
    start = time.time()
    topo, env = read_topology(), {**versions(), "cuda_aware_mpi": comm.cuda_aware}
    if comm.rank == 0:
        print(f"versions: {json.dumps(env)}")
        print(f"topology: {json.dumps(topo.to_dict())}")
    binding = bind_threads(cfg, comm, topo)
    device = select_device(cfg, comm, run_dir)
    binding["gpu"] = device.index if device.type == "cuda" else None
    bindings = comm.allgather_object(binding)
    where = (
        f"{binding['host']}, cores {binding['cores']} (NUMA {binding['numa']}), {binding['threads']} threads"
    )
    print(
        f"rank {comm.rank}/{comm.size} on {where}"
        + (f", GPU {binding['gpu']}" if binding["gpu"] is not None else "")
    )
    if comm.rank == 0:
        plan_file = run_dir / "plan.json"
        plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
        problems = check_bindings(bindings, cfg.hardware.bind, plan)
        for problem in problems:
            print(f"warning: {problem}", file=sys.stderr)
        report = {"ranks": bindings, "plan": plan, "problems": problems}
        (run_dir / "bindings.json").write_text(json.dumps(report, indent=1))
    torch.manual_seed(cfg.train.seed + (0 if cfg.train.same_init else comm.rank))
    model = instantiate(cfg.model).to(device)
    if cfg.train.same_init:
        broadcast_state(model, comm)
    torch.manual_seed(cfg.train.seed + 1000 * comm.rank + 1)
    rule = instantiate(cfg.rule, comm=comm)
    if rule.is_server:
        print(f"rank {comm.rank}: server of {type(rule).__name__}")
        rule.serve(model)
        rule.final_metrics()
        return None
    data = instantiate(cfg.data)
    optimizer = instantiate(cfg.optim, params=model.parameters())
    log = MetricsLog(run_dir, enabled=comm.rank == 0)
    try:
        trainer = Trainer(
            cfg.train,
            model,
            optimizer,
            data,
            rule,
            device,
            log,
            terminal=terminal if comm.rank == 0 else None,
            log_file=log_file,
        )
        result = trainer.fit()
        final = rule.final_metrics()
        if final:
            log.write("final", result["steps"], **final)
    finally:
        log.close()
    if cfg.train.save_model != "none" and comm.rank == 0:
        torch.save(trainer.reported_model.state_dict(), run_dir / "model.pt")
    if cfg.train.save_model == "all":
        torch.save(model.state_dict(), run_dir / f"model.rank{comm.rank}.pt")
    if comm.rank != 0:
        return None
    summary = {
        "status": "ok",
        "rule": cfg.rule._target_.rsplit(".", 1)[-1].lower(),
        "model": cfg.model._target_,
        "data": cfg.data._target_,
        "devices": cfg.devices,
        "world_size": comm.size,
        "versions": env,
        "topology": topo.to_dict(),
        **result,
        **final,
        "worker_wall_time_s": time.time() - start,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: mpirun ... python -m mpi4py -m runner.worker RUN_DIR")
    run_dir = Path(argv[0])
    os.environ[OWNER_ENV] = str(os.getpid())
    cfg = OmegaConf.load(run_dir / "config.yaml")
    comm = Comm(cuda_aware=cfg.hardware.cuda_aware)
    log_file, terminal = redirect_output(run_dir, comm.rank)
    try:
        run(cfg, run_dir, comm, log_file, terminal)
    except BaseException as err:
        (run_dir / "logs" / f"rank{comm.rank}.error").write_text(
            f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}"
        )
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    main()
