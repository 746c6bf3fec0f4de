"""The worker entry point, one process per rank: ``python -m runner.rank.worker RUN_DIR`` under mpirun.

It reads the config the launcher checked and wrote into RUN_DIR (Hydra does not run here), initialises MPI,
sends its output to ``RUN_DIR/logs/rank<r>.log`` (rank 0 also to the terminal), is placed on its cores
and device, builds the roles (which ranks train, which serve), the model, data, optimizer and rule from
their schemas, and trains. An exception is written to ``RUN_DIR/logs/rank<r>.error`` and to the rank's
log, and aborts the whole job (``MPI_Abort``), so no peer waits forever for a rank that is gone.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import torch

from runner.comm import mpi
from runner.hardware.topology import read_topology
from runner.rank.checkpoint import (
    Checkpointer,
    Control,
    latest_checkpoint,
    load_part,
    rng_state,
    save_atomic,
    set_rng_state,
)
from runner.rank.guard import Diverged
from runner.rank.heartbeat import Heartbeat
from runner.rank.loop import Position, Trainer, broadcast_state
from runner.rank.meter import Meter
from runner.rank.metrics import MetricsLog, dumps, read_json, write_atomic
from runner.rank.output import redirect_output, root_cause
from runner.rank.placement import place_rank
from runner.rank.recovery import Recovery
from runner.rules.base import RuleContext, split_roles
from runner.schema.config import Config, load, monitored
from runner.schema.identity import IDENTITY_FILE

#: Steps between the workers' agreements on checkpoints and stops for asynchronous rules (so they drift
#: at most this many steps apart); synchronous rules agree after every step.
ASYNC_CONTROL_INTERVAL = 16


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


def run(
    cfg: Config, run_dir: Path, comm: mpi.Comm, log_file: TextIO, terminal: TextIO, beat: Heartbeat
) -> None:
    """Everything one rank does, from placement to the run's records (resuming from the run folder's
    latest checkpoint when the launcher set ``resume``)."""
    start = time.time()
    topo, env = read_topology(), versions(comm)
    if comm.rank == 0:
        print(f"versions: {json.dumps(env)}")
        print(f"topology: {json.dumps(topo.to_dict())}")
    device, _ = place_rank(cfg.hardware, comm, run_dir)
    tolerant = cfg.hardware.fault_tolerance == "continue"
    if tolerant:
        comm.return_errors()
        hosts = comm.allgather_object(platform.node())
    workers = split_roles(comm, cfg.rule.extra_ranks())
    entry = latest_checkpoint(run_dir, comm.size) if cfg.resume else None
    part = load_part(run_dir, entry, comm.rank) if entry else None
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, comm, entry)
    train = cfg.train
    torch.manual_seed(train.seed + (0 if train.same_init else comm.rank))
    model = cfg.model.build().to(device)
    if train.same_init:
        broadcast_state(model, comm)
    torch.manual_seed(train.seed + 1000 * comm.rank + 1)
    if workers is None:
        beat.set_role("server")

        def save_server(step: int, state: dict[str, Any]) -> None:
            checkpointer.save(step, {"rule": state, "rng": rng_state()})

        rule = cfg.rule.build(RuleContext(comm, None, model, save=save_server))
        if part:
            rule.load_state_dict(part["rule"])
            set_rng_state(part["rng"])
        print(f"rank {comm.rank}: server of {type(rule).__name__}")
        rule.serve()
        if tolerant:
            comm.fault_barrier()
        rule.final_metrics()
        return
    data = cfg.data.build()
    pin = device.type == "cuda"
    loaders = (
        data.train_loader(workers.rank, workers.size, train.batch_size, train.seed, pin_memory=pin),
        data.val_loader(workers.rank, workers.size, train.val_batch_size, pin_memory=pin),
    )
    steps_per_epoch = len(loaders[0]) // train.accumulate
    if steps_per_epoch == 0:
        raise ValueError(
            f"train.accumulate={train.accumulate} is invalid: an epoch has only {len(loaders[0])} batches of "
            f"train.batch_size={train.batch_size} per rank; lower train.accumulate or the batch size"
        )
    if train.precision == "fp16" and device.type != "cuda":
        raise ValueError("train.precision=fp16 needs a GPU (this rank runs on the CPU): use bf16 on CPUs")
    if comm.rank == 0 and train.batch_size > len(loaders[0].sampler):
        print(
            f"warning: train.batch_size={train.batch_size} exceeds this rank's shard of "
            f"{len(loaders[0].sampler)} samples: every step trains on the whole shard"
        )
    straggler = cfg.simulate.record()
    if comm.rank == 0 and straggler:
        print(f"simulated stragglers: ranks {straggler['ranks']} sleep {straggler['ms']:g} ms per step")
    max_steps = train.max_steps or train.epochs * steps_per_epoch
    epochs = min(train.epochs, -(-max_steps // steps_per_epoch))
    total_steps = min(max_steps, epochs * steps_per_epoch)  # what the run will do: the schedule's length
    optimizer = cfg.optim.build(model.parameters())
    rule = cfg.rule.build(RuleContext(comm, workers, model, optimizer, steps_per_epoch))
    schedule = cfg.schedule.build(optimizer, total_steps, rule.lr_factor)
    task = cfg.task.build(data.num_classes)
    resume = (entry.get("metrics_lines", 0), entry["step"], entry.get("elapsed", 0.0)) if entry else None
    log = MetricsLog(run_dir, enabled=comm.rank == 0, resume=resume)
    meter = Meter(
        comm.stats,
        workers.size,
        total_steps,
        log,
        train.log_every,
        terminal=terminal if comm.rank == 0 else None,
        log_file=log_file,
        progress=train.progress,
    )
    interval = 1 if rule.synchronous else ASYNC_CONTROL_INTERVAL
    control = Control(workers, run_dir, checkpointer, interval, part["loop"]["step"] if part else 0)
    recovery = None
    if tolerant:
        recovery = Recovery(
            workers,
            comm,
            cfg.rule.extra_ranks(),
            run_dir,
            cfg.hardware.min_workers,
            terminal,
            lambda r, n: data.val_loader(r, n, train.val_batch_size, pin_memory=pin),
            hosts,
        )
    trainer: Trainer

    def checkpoint(pos: Position, end: bool) -> None:
        rule.before_checkpoint(pos.step)
        loop = {"step": pos.step, "epoch": pos.epoch, "batch": pos.batch, **trainer.state_dict()}
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rule": rule.state_dict(),
            "loop": loop,
            "rng": rng_state(),
        }
        log.flush()
        info = {
            "epoch": pos.epoch,
            "batch": pos.batch,
            "end": end,
            "metrics_lines": log.lines,
            "elapsed": log.elapsed(),
            "validation": trainer.history[-1] if trainer.history else None,
        }
        checkpointer.save(pos.step, state, info)
        meter.echo(f"checkpoint after step {pos.step} (epoch {pos.epoch}, batch {pos.batch})")

    start_at = Position()
    try:
        trainer = Trainer(
            train,
            model,
            optimizer,
            loaders,
            rule,
            workers,
            comm.stats,
            device,
            log,
            meter,
            control,
            checkpoint,
            beat,
            recovery,
            delay_s=cfg.simulate.delay_s(comm.rank),
            task=task,
            schedule=schedule,
            monitor=monitored(cfg),
        )
        if part:
            model.load_state_dict(part["model"])
            optimizer.load_state_dict(part["optimizer"])
            rule.load_state_dict(part["rule"])
            loop = part["loop"]
            start_at = Position(loop["step"], loop["epoch"], loop["batch"])
            trainer.load_state_dict(loop, start_at.step, mid_epoch=start_at.batch > 0)
            set_rng_state(part["rng"])
            meter.echo(f"resumed from the checkpoint after step {start_at.step} ({entry['dir']})")
        reported, result = trainer.fit(max_steps, epochs, start_at)
        if recovery is not None:
            comm.fault_barrier()
            result.update(recovery.summary())
        final = rule.final_metrics()
        if final:
            log.write("final", result["steps"], **final)
        ident = read_json(run_dir / IDENTITY_FILE)
        monitor = monitored(cfg)
        log.hparams(
            ident.get("swept", {}),
            {f"hparam/{k}_{monitor}": result.get(f"{k}_{monitor}") for k in ("final", "best")},
        )
    finally:
        log.close()
    if train.save_model != "none" and comm.rank == 0:
        save_atomic(reported.state_dict(), run_dir / "model.pt")
    if train.save_model == "all":
        save_atomic(model.state_dict(), run_dir / f"model.rank{comm.rank}.pt")
    if comm.rank == 0:
        summary = {
            "status": "preempted" if trainer.preempted else "ok",
            **ident,
            "rule": type(cfg.rule).__module__.rsplit(".", 1)[-1],
            "model": f"{type(model).__module__}.{type(model).__qualname__}",
            "data": cfg.data.name(),
            "task": type(cfg.task).__module__.rsplit(".", 1)[-1],
            "devices": cfg.devices,
            "world_size": comm.size,
            "resumed_from_step": entry["step"] if entry else None,
            "straggler": straggler,
            "checkpoint": checkpointer.latest,
            "versions": env,
            "topology": topo.to_dict(),
            **result,
            **final,
            "worker_wall_time_s": time.time() - start,
        }
        write_atomic(run_dir / "summary.json", dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: mpirun ... python -m runner.rank.worker RUN_DIR")
    run_dir = Path(argv[0])
    comm = mpi.init()
    log_file, terminal = redirect_output(run_dir, comm.rank)
    beat = Heartbeat(run_dir, comm.rank, counter=lambda: comm.stats.seconds)
    try:
        cfg = load(str(run_dir / "config.yaml"))
        if cfg.hardware.cuda_aware is not None:
            comm.cuda_aware = cfg.hardware.cuda_aware
        run(cfg, run_dir, comm, log_file, terminal, beat)
    except BaseException as err:
        cause = root_cause(err)
        try:
            (run_dir / "logs" / f"rank{comm.rank}.error").write_text(f"{cause}\n\n{traceback.format_exc()}")
        except OSError as io:
            print(f"rank {comm.rank}: could not write its error file: {io}", file=sys.stderr)
        log_file.write(traceback.format_exc())
        print(f"rank {comm.rank} failed: {cause}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if isinstance(err, Diverged):
            status = 3
        elif isinstance(err, SystemExit) and isinstance(err.code, int) and err.code:
            status = err.code
        else:
            status = 1
        mpi.abort(status)
        raise
    finally:
        beat.close()
    sys.stdout.flush()
    sys.stderr.flush()
    if comm.tolerant:  # after a lost rank, ULFM's MPI_Finalize (or loader shutdown) was seen to hang
        log_file.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
