"""A rank's parts, assembled.

What it knows once placed (:class:`Rank`), its model, and a worker's loaders, dealer, records, agreement and
trainer (:func:`build`), each given what it uses.

:mod:`runner.rank.worker` places the rank and runs it; this module builds what it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from runner.comm import mpi
from runner.data.base import spread
from runner.optim import OptimConfig
from runner.rank.agreement import Board, Control
from runner.rank.assignment import Chunks, Dealer, counter_slots, plan
from runner.rank.checkpoint import Checkpointer
from runner.rank.loop import Parts, Place, Records, Trainer
from runner.rank.records.heartbeat import Heartbeat
from runner.rank.records.meter import Meter
from runner.rank.records.metrics import MetricsLog
from runner.rank.resilience.elastic import Elastic
from runner.rank.resilience.recovery import Recovery
from runner.rank.state import broadcast_state, run_length
from runner.rules.base import Rule, RuleContext
from runner.schema.config import Config, monitored

#: Steps between the workers' agreements on checkpoints and stops for asynchronous rules (so they drift
#: at most this many steps apart); synchronous rules agree after every step.
ASYNC_CONTROL_INTERVAL = 16


@dataclass
class Rank:
    """What a rank knows once placed.

    Its config and folder, its communicators (``workers`` None on a server rank), device, the checkpoint it
    resumes from (``entry``, and ``part``, its own part of it), its streams, and what it found of the
    machine (``env``, ``topology``)."""

    cfg: Config
    run_dir: Path
    comm: mpi.Comm
    workers: mpi.Comm | None
    device: torch.device
    hosts: list[str] | None  # every rank's host, by launch rank (fault tolerance only)
    entry: dict[str, Any] | None
    part: dict[str, Any] | None
    checkpointer: Checkpointer
    streams: tuple[TextIO, TextIO]  # (its log file, the terminal)
    beat: Heartbeat
    env: dict[str, Any]
    topology: dict[str, Any]
    elastic: Elastic | None = None  # the job may grow (fault_tolerance=heal, hardware.max_workers)
    joined: bool = False  # this worker was spawned into the running job


def build_model(rank: Rank) -> nn.Module:
    """The model, on the rank's device: rank 0's initial parameters on every rank (``train.same_init``)."""
    train, comm = rank.cfg.train, rank.comm
    torch.manual_seed(train.seed + (0 if train.same_init else comm.rank))
    model = rank.cfg.model.build().to(rank.device)
    if train.same_init and not rank.joined:  # a joined worker takes worker 0's model when it is welcomed
        broadcast_state(model, comm)
    torch.manual_seed(train.seed + 1000 * comm.rank + 1)
    return model


def val_share(rank: Rank, data: Any) -> Callable[[int, int], Any]:
    """``(r, n) ->`` the loader of share ``r`` of ``n`` of the validation data.

    This worker's, and the survivors' new shares after a worker is lost."""
    batch, pin = rank.cfg.train.val_batch_size, rank.device.type == "cuda" and not data.resident
    return lambda r, n: data.val_loader(r, n, batch, pin_memory=pin)


def dealer(rank: Rank, data: Any) -> Dealer | None:
    """This worker's dealer of chunks under dynamic assignment (``data.assignment``), else None."""
    cfg, workers, tolerant = rank.cfg, rank.workers, rank.hosts is not None
    if not cfg.data.dynamic(cfg.rule.asynchronous()):
        return None
    train = cfg.train
    chunks = Chunks(len(data.train), train.batch_size, train.accumulate, train.seed)
    total, _, steps = plan(chunks, train.epochs, train.max_steps, workers.size)
    counter = None if rank.joined else workers.counter(counter_slots(workers.size))  # joined: when welcomed
    block = cfg.data.draw_block(cfg.devices)  # (the job's size as launched: the counter's layout stays)
    return Dealer(chunks, counter, total, steps, workers.rank, publish=tolerant, block=block)


def loaders(rank: Rank, data: Any) -> tuple[tuple[Any, Any], int]:
    """This worker's training and validation loaders, and the optimizer steps of an epoch.

    Under dynamic assignment, an epoch's steps are its chunks per worker. Refuses a setting the data cannot
    serve."""
    train, workers, pin = rank.cfg.train, rank.workers, rank.device.type == "cuda" and not data.resident
    dealt = dealer(rank, data)
    pair = (
        data.train_loader(workers.rank, workers.size, train.batch_size, train.seed, pin_memory=pin)
        if dealt is None
        else data.dealt_loader(dealt, train.seed + 7919 * workers.rank, pin_memory=pin),
        val_share(rank, data)(workers.rank, workers.size),
    )
    steps_per_epoch = len(pair[0]) // train.accumulate
    if dealt is not None:
        steps_per_epoch = -(-dealt.chunks.per_epoch // workers.size)
    if steps_per_epoch == 0:
        raise ValueError(
            f"train.accumulate={train.accumulate} is invalid: an epoch has only {len(pair[0])} batches of "
            f"train.batch_size={train.batch_size} per rank; lower train.accumulate or the batch size"
        )
    if train.precision == "fp16" and rank.device.type != "cuda":
        raise ValueError("train.precision=fp16 needs a GPU (this rank runs on the CPU): use bf16 on CPUs")
    if rank.comm.rank == 0 and dealt is None and train.batch_size > len(pair[0].sampler):
        print(
            f"warning: train.batch_size={train.batch_size} exceeds this rank's shard of "
            f"{len(pair[0].sampler)} samples: every step trains on the whole shard"
        )
    return pair, steps_per_epoch


def build(rank: Rank, model: nn.Module) -> tuple[Trainer, int, int]:
    """A worker's trainer, with the epochs and steps the run takes."""
    cfg, comm, workers = rank.cfg, rank.comm, rank.workers
    data = cfg.data.build()
    data.val = spread(data.val, cfg.train.val_samples)  # (a validation costs the same however long the run)
    if (moved := data.place(rank.device)) and comm.rank == 0:
        print(f"data: in GPU memory ({moved / 2**20:.0f} MiB), each batch gathered there")
    pair, steps_per_epoch = loaders(rank, data)
    straggler = cfg.simulate.record()
    how = "spin" if cfg.simulate.spin else "sleep"
    if comm.rank == 0 and straggler and "ranks" in straggler:
        print(f"simulated stragglers: ranks {straggler['ranks']} {how} {straggler['ms']:g} ms per step")
    if comm.rank == 0 and straggler and "jitter_ms" in straggler:
        delays = [f"{1e3 * cfg.simulate.delay_s(r):.1f}" for r in range(workers.size)]
        print(f"simulated speeds: the workers {how} {', '.join(delays)} ms per step")
    epochs, steps = run_length(cfg.train.epochs, cfg.train.max_steps, steps_per_epoch)
    dealt = pair[0].batch_sampler if isinstance(pair[0].batch_sampler, Dealer) else None
    if dealt is not None:
        _, epochs, steps = plan(dealt.chunks, cfg.train.epochs, cfg.train.max_steps, workers.size)
        if comm.rank == 0:
            print(
                f"data: dynamic assignment, {dealt.chunks.per_epoch} chunks of {dealt.chunks.size} samples "
                "per epoch, dealt to the workers as they ask"
            )
    params = cfg.optim.params(model) if isinstance(cfg.optim, OptimConfig) else model.parameters()
    optimizer = cfg.optim.build(params)
    rule = cfg.rule.build(RuleContext(comm, workers, model, optimizer, steps_per_epoch, joined=rank.joined))
    schedule = cfg.schedule.build(optimizer, steps, rule.lr_factor)
    parts = Parts(model, optimizer, rule, cfg.task.build(data.num_classes), schedule)
    recovery = None
    if rank.hosts is not None:
        recovery = Recovery(
            workers=workers,
            world=comm,
            servers=cfg.rule.extra_ranks(),
            run_dir=rank.run_dir,
            min_workers=cfg.hardware.min_workers,
            terminal=rank.streams[1],
            val_loader=val_share(rank, data),
            hosts=rank.hosts,
            elastic=rank.elastic,
            heal=cfg.hardware.fault_tolerance == "heal",
            fence=rank.checkpointer.fence,
        )
    place = Place(workers, rank.device, cfg.simulate.delay_s(comm.rank), cfg.simulate.spin)
    kept = records(rank, rule, steps, dealt)
    trainer = Trainer(cfg.train, parts, pair, place, kept, recovery)
    trainer.validator.val_share = val_share(rank, data)
    return trainer, epochs, steps


def records(rank: Rank, rule: Rule, steps: int, dealt: Dealer | None = None) -> Records:
    """The worker's records (rank 0 writes them), its meter, and the workers' agreement (:func:`agreement`).

    A resumed run continues its records from the checkpoint's."""
    cfg, comm, entry = rank.cfg, rank.comm, rank.entry
    resume = (entry.get("metrics_lines", 0), entry["step"], entry.get("elapsed", 0.0)) if entry else None
    log = MetricsLog(rank.run_dir, enabled=comm.rank == 0, resume=resume, loggers=cfg.logger)
    log_file, terminal = rank.streams
    meter = Meter(
        comm.stats,
        rank.workers.size,
        steps,
        log,
        cfg.train.log_every,
        terminal=terminal if comm.rank == 0 else None,
        log_file=log_file,
        progress=cfg.train.progress,
        tokens_per_sample=cfg.task.tokens_per_sample(list(cfg.data.shape or [])),
    )
    return Records(log, meter, rank.beat, agreement(rank, rule, dealt), monitored(cfg))


def agreement(rank: Rank, rule: Rule, dealt: Dealer | None) -> Control:
    """The workers' agreement on checkpoints and stops.

    Posted on the dealer's counter (a :class:`Board`) where they never wait on each other (dynamic assignment,
    a rule whose workers validate alone), else an all-reduce after every step (an interval of them,
    asynchronous rules; at meetings, dynamic assignment)."""
    if dealt is not None and rule.solo_validation:
        return Board(rank.workers, rank.run_dir, rank.checkpointer, lambda: dealt.counter)
    part = rank.part
    interval = 1 if rule.synchronous or dealt is not None else ASYNC_CONTROL_INTERVAL
    start = part["loop"]["step"] if part else 0
    if dealt is not None and part:  # dynamic assignment: the workers agree at meetings, counted over the run
        start = (part["loop"].get("deal") or {}).get("meetings", 0)
    return Control(rank.workers, rank.run_dir, rank.checkpointer, interval, start, not rank.joined)
