"""The worker entry point, one process per rank: ``python -m runner.worker RUN_DIR`` under mpirun.

It reads the config the launcher checked and wrote into RUN_DIR (Hydra does not run here), initialises MPI,
sends its output to ``RUN_DIR/logs/rank<r>.log`` (rank 0 also to the terminal), is placed on its cores
and device, builds the roles (which ranks train, which serve), the model, data, optimizer and rule from
their schemas, and trains. An exception is written to ``RUN_DIR/logs/rank<r>.error`` and to the rank's
log, and aborts the whole job (``MPI_Abort``), so no peer waits forever for a rank that is gone.
"""

from __future__ import annotations

import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import torch

from runner import comm as mpi
from runner.config import Config, load
from runner.hardware.placement import place_rank
from runner.hardware.topology import read_topology
from runner.loop import Trainer, broadcast_state
from runner.meter import Meter
from runner.metrics import MetricsLog
from runner.rules.base import RuleContext, split_roles


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


def versions(comm: mpi.Comm) -> dict[str, Any]:
    import numpy

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        **mpi.versions(),
        "cuda": torch.version.cuda or "none",
        "cuda_aware_mpi": comm.cuda_aware,
    }


def run(cfg: Config, run_dir: Path, comm: mpi.Comm, log_file: TextIO, terminal: TextIO) -> None:
    """Everything one rank does, from placement to the run's records."""
    start = time.time()
    topo, env = read_topology(), versions(comm)
    if comm.rank == 0:
        print(f"versions: {json.dumps(env)}")
        print(f"topology: {json.dumps(topo.to_dict())}")
    device, _ = place_rank(cfg.hardware, comm, run_dir)
    workers = split_roles(comm, cfg.rule.extra_ranks())
    train = cfg.train
    torch.manual_seed(train.seed + (0 if train.same_init else comm.rank))
    model = cfg.model.build().to(device)
    if train.same_init:
        broadcast_state(model, comm)
    torch.manual_seed(train.seed + 1000 * comm.rank + 1)
    if workers is None:
        rule = cfg.rule.build(RuleContext(comm, None, model))
        print(f"rank {comm.rank}: server of {type(rule).__name__}")
        rule.serve()
        rule.final_metrics()
        return
    data = cfg.data.build()
    pin = device.type == "cuda"
    loaders = (
        data.train_loader(workers.rank, workers.size, train.batch_size, train.seed, pin_memory=pin),
        data.val_loader(workers.rank, workers.size, train.val_batch_size, pin_memory=pin),
    )
    steps_per_epoch = len(loaders[0])
    max_steps = train.max_steps or train.epochs * steps_per_epoch
    epochs = min(train.epochs, -(-max_steps // steps_per_epoch))
    optimizer = cfg.optim.build(model.parameters())
    rule = cfg.rule.build(RuleContext(comm, workers, model, optimizer, steps_per_epoch))
    log = MetricsLog(run_dir, enabled=comm.rank == 0)
    meter = Meter(
        comm.stats,
        workers.size,
        max_steps,
        log,
        train.log_every,
        terminal=terminal if comm.rank == 0 else None,
        log_file=log_file,
        progress=train.progress,
    )
    try:
        trainer = Trainer(train, model, optimizer, loaders, rule, workers, comm.stats, device, log, meter)
        reported, result = trainer.fit(max_steps, epochs)
        final = rule.final_metrics()
        if final:
            log.write("final", result["steps"], **final)
    finally:
        log.close()
    if train.save_model != "none" and comm.rank == 0:
        torch.save(reported.state_dict(), run_dir / "model.pt")
    if train.save_model == "all":
        torch.save(model.state_dict(), run_dir / f"model.rank{comm.rank}.pt")
    if comm.rank == 0:
        summary = {
            "status": "ok",
            "rule": type(cfg.rule).__module__.rsplit(".", 1)[-1],
            "model": f"{type(model).__module__}.{type(model).__qualname__}",
            "data": f"{type(cfg.data).__module__}.{type(cfg.data).__qualname__.removesuffix('Config')}",
            "devices": cfg.devices,
            "world_size": comm.size,
            "versions": env,
            "topology": topo.to_dict(),
            **result,
            **final,
            "worker_wall_time_s": time.time() - start,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: mpirun ... python -m runner.worker RUN_DIR")
    run_dir = Path(argv[0])
    comm = mpi.init()
    log_file, terminal = redirect_output(run_dir, comm.rank)
    try:
        cfg = load(str(run_dir / "config.yaml"))
        if cfg.hardware.cuda_aware is not None:
            comm.cuda_aware = cfg.hardware.cuda_aware
        run(cfg, run_dir, comm, log_file, terminal)
    except BaseException as err:
        (run_dir / "logs" / f"rank{comm.rank}.error").write_text(
            f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}"
        )
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        mpi.abort(err.code if isinstance(err, SystemExit) and isinstance(err.code, int) and err.code else 1)
        raise
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
