"""The worker entry point, one process per rank: ``python -m runner.rank.worker RUN_DIR`` under mpirun.

It reads the config the launcher checked and wrote into RUN_DIR (Hydra does not run here), initialises MPI,
sends its output to ``RUN_DIR/logs/rank<r>.log`` (rank 0 also to the terminal), and then, in order:

1. :func:`place`: binds the rank to its cores and device, splits the roles (which ranks train, which serve)
   and finds the checkpoint to resume from;
2. :func:`build_model`: the model, the same on every rank;
3. :func:`serve`: a server rank (ASGD's parameter servers) serves until the workers are done; or
4. :func:`build`: a worker builds its data, optimizer, rule, task, schedule and records into a
   :class:`~runner.rank.loop.Trainer`;
5. :func:`fit`: restores the checkpoint's state, trains, and records the rule's final metrics;
6. :func:`finish`: saves the model and writes ``summary.json``.

An exception is written to ``RUN_DIR/logs/rank<r>.error`` and to the rank's log, and aborts the whole job
(``MPI_Abort``), so no peer waits forever for a rank that is gone.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from runner.comm import mpi, spares
from runner.comm.links import emulated
from runner.comm.routes.hierarchical import settle as settle_hierarchy
from runner.folder_files import write_text
from runner.hardware.base import HardwareConfig
from runner.hardware.topology import read_topology
from runner.rank import dynamo
from runner.rank.assembly import Rank, build, build_model
from runner.rank.checkpoint import Checkpointer, latest_checkpoint, load_part, rng_state, set_rng_state
from runner.rank.fence import Fence, Partitioned
from runner.rank.guard import Diverged
from runner.rank.loop import Trainer
from runner.rank.placement import choose_transport, place_rank
from runner.rank.records.heartbeat import Heartbeat
from runner.rank.records.output import end_job, redirect_output, root_cause
from runner.rank.resilience.elastic import Elastic, NotJoined, arrive
from runner.rank.resilience.growth import Growth
from runner.rank.resilience.spare import stand_by
from runner.rank.saved_model import save_model
from runner.rank.state import Position
from runner.rules.base import Rule, RuleContext, split_roles
from runner.run_folder import (
    CONFIG,
    EXIT,
    IDENTITY,
    MODEL,
    PARTITIONED,
    rank_file,
    rank_model,
    read_json,
    write_summary,
)
from runner.schema import option_name
from runner.schema.config import Config, load


def versions(comm: mpi.Comm) -> dict[str, Any]:
    """The versions of what this rank runs on (recorded in summary.json)."""
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
    cfg: Config,
    run_dir: Path,
    comm: mpi.Comm,
    streams: tuple[TextIO, TextIO],
    beat: Heartbeat,
    joined: bool = False,
) -> None:
    """Everything one rank does, from placement to the run's records.

    It resumes from the run folder's latest checkpoint when the launcher set ``resume``; ``joined``:
    spawned into the running job, it starts from worker 0's state."""
    start = time.time()
    comm.stats.links = emulated(cfg.simulate)  # simulate.ranks_per_node, link_gbps: runner/comm/links.py
    rank = (place_joined if joined else place)(cfg, run_dir, comm, streams, beat)
    model = build_model(rank)
    if rank.workers is None:
        serve(rank, model)
        return
    trainer, epochs, steps = build(rank, model)
    start_at = None
    if rank.hosts is not None and not joined:
        comm.barrier()  # every rank is past the start-up collectives before any trains (see serve)
    if joined:
        start_at = welcomed(trainer.growth)
        print(f"rank {comm.launch_rank()}: joined the job at step {start_at.step} as worker {comm.rank}")
    reported, result = fit(rank, trainer, epochs, steps, start_at)
    wall = time.time() - start
    finish(rank, trainer, reported, result, wall)
    if rank.hosts is not None and lost_after_summary(rank.comm, trainer, result):
        finish(rank, trainer, reported, result, wall)  # by the lowest survivor, now rank 0
    trainer.log.finish()  # the summary and model to the loggers (MLflow, W&B)
    trainer.close()


def welcomed(growth: Growth) -> Position:
    """A spawned worker's welcome into the job; where it starts.

    A rank lost during it raises :class:`NotJoined`, as in its first meeting (:func:`arrive`): this worker
    has no state to recover with, and the ranks that spawned it count it lost with the other and heal anew
    (its error would end the job they go on with; seen in CI: ``PeerLost: split`` in the welcome)."""
    try:
        return growth.welcome(Position(), False, joined=True)[0]
    except mpi.PeerLost as err:
        why = f"a rank was lost while this replacement was welcomed ({err}); the job goes on"
        raise NotJoined(why) from None


def place(
    cfg: Config, run_dir: Path, comm: mpi.Comm, streams: tuple[TextIO, TextIO], beat: Heartbeat
) -> Rank:
    """Bind this rank to its cores and device, split the roles, and find the checkpoint to resume from."""
    topology, env = read_topology().to_dict(), versions(comm)
    if comm.rank == 0:  # for the log (summary.json has the versions too), not the console
        streams[0].write(f"versions: {json.dumps(env)}\ntopology: {json.dumps(topology)}\n")
    device, _ = place_rank(cfg.hardware, comm, run_dir)
    hosts = None
    if cfg.hardware.tolerant:
        comm.return_errors()
        # by id: the spares' too (runner.comm.spares), so that spawned workers' ids come after theirs
        hosts = list(comm.spares.hosts) if comm.spares else comm.allgather_object(platform.node())
    servers = cfg.rule.extra_ranks()
    workers = split_roles(comm, servers)
    if workers is not None:
        env["transport"] = attach_transport(cfg.hardware, workers, device)
        env["hierarchical"] = settle_hierarchy(workers, cfg.hardware.hierarchical)
    entry = latest_checkpoint(run_dir, comm.size) if cfg.resume else None
    part = load_part(run_dir, entry, comm.rank) if entry else None
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, comm, entry, servers=servers)
    elastic = None
    if hosts is not None:
        elastic = Elastic(comm, workers, servers, run_dir, hosts, most_workers(cfg, comm), cfg.hardware.env)
    return Rank(
        cfg,
        run_dir,
        comm,
        workers,
        device,
        hosts,
        entry,
        part,
        checkpointer,
        streams,
        beat,
        env,
        topology,
        elastic,
    )


def attach_transport(hw: HardwareConfig, workers: mpi.Comm, device: torch.device) -> str:
    """Collective over the workers: put their tensor collectives on the transport of ``hardware.transport``.

    ``auto``: NCCL on GPUs where it can run, else MPI, said in one line. Returns its name."""
    name, why = choose_transport(hw, workers, device)
    if why is not None and workers.rank == 0:
        print(f"transport: mpi, staged through host memory, since {why}")
    if name != "mpi":
        workers.use_transport(name)
    return name


def most_workers(cfg: Config, world: mpi.Comm) -> int:
    """The most workers the job may have (``hardware.max_workers``, default ``devices``).

    A resumed job that had grown has more."""
    return max(cfg.hardware.max_workers or cfg.devices, world.size - cfg.rule.extra_ranks())


def place_joined(
    cfg: Config, run_dir: Path, comm: mpi.Comm, streams: tuple[TextIO, TextIO], beat: Heartbeat
) -> Rank:
    """A worker spawned into the running job: its device, and its part in the job's growth.

    It takes that part with the ranks that spawned it (:func:`runner.rank.resilience.elastic.arrive`). It
    is bound by mpirun's placement of the new processes; on GPUs it takes the GPU of its place among the
    workers on its node."""
    topology, env = read_topology().to_dict(), versions(comm)
    hw = cfg.hardware
    elastic = arrive(comm, cfg.rule.extra_ranks(), run_dir, most_workers(cfg, comm), hw.env)
    device = torch.device("cpu")
    if hw.device == "cuda":
        device = torch.device("cuda", elastic.workers.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    fence = Fence(run_dir, comm.tolerant)
    fence.generation = fence.current()  # spawned by the membership that holds the run folder now
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, comm, None, fence, cfg.rule.extra_ranks())
    return Rank(
        cfg,
        run_dir,
        comm,
        elastic.workers,
        device,
        elastic.hosts,
        None,
        None,
        checkpointer,
        streams,
        beat,
        env,
        topology,
        elastic,
        joined=True,
    )


def serve(rank: Rank, model: nn.Module) -> None:
    """A server rank: serve the workers (the rule's :meth:`~runner.rules.base.Rule.serve`) until they end."""
    rank.beat.set_role("server")

    def save(step: int, state: dict[str, Any]) -> None:
        rank.checkpointer.save(step, {"rule": state, "rng": rng_state()})

    grow = (lambda: rank.elastic.grow(0)) if rank.elastic is not None else None
    rule = rank.cfg.rule.build(RuleContext(rank.comm, None, model, save=save, grow=grow))
    if rank.part:
        rule.load_state_dict(rank.part["rule"])
        set_rng_state(rank.part["rng"])
    if rank.hosts is not None:  # fault tolerance: no worker trains, and may be lost, while a rank is still
        rank.comm.barrier()  # in the start-up collectives (those are not recovered from)
    print(f"rank {rank.comm.rank}: server of {type(rule).__name__}")
    rule.serve()
    final_metrics(rank.comm, rule, (lambda lost: None) if rank.hosts is not None else None)
    if rank.hosts is not None:
        rank.comm.fault_barrier()  # the job's last meeting (lost_after_summary)


def final_metrics(
    world: mpi.Comm, rule: Rule, noted: Callable[[list[int]], None] | None
) -> dict[str, object]:
    """Collective over all ranks after training: the rule's final metrics.

    Under fault tolerance (``noted`` is told the ranks lost) after a job-wide barrier, and again, by all
    alike, after one lost within."""
    while True:
        if noted is not None:
            noted(world.fault_barrier())
        try:
            final = rule.final_metrics()
            if noted is not None:
                world.agree()  # (one may complete where another's fails)
            return final
        except mpi.PeerLost:
            if noted is None:
                raise


def fit(
    rank: Rank, trainer: Trainer, epochs: int, steps: int, start_at: Position | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """Restore the checkpoint's state (when resuming), train from ``start_at``, and record the final metrics.

    A joined worker starts where worker 0 was. The metrics are the rule's. Returns the model the run reports
    and the run's results."""
    log = trainer.log
    try:
        start_at = start_at or Position()
        if rank.part:
            start_at = trainer.restore(rank.part)
            trainer.meter.echo(
                f"resumed from the checkpoint after step {start_at.step} ({rank.entry['dir']})"
            )
        reported, result = trainer.fit(steps, epochs, start_at)
        recovery, steps_run = trainer.recovery, result["steps"]
        noted = (lambda lost: recovery.lost_at_end(trainer.survivors, lost, steps_run)) if recovery else None
        final = final_metrics(rank.comm, trainer.rule, noted)
        if recovery is not None:
            result.update(recovery.summary())
        if final:
            log.write("final", result["steps"], **final)
        swept = read_json(rank.run_dir / IDENTITY).get("swept", {})
        monitor = trainer.monitor
        log.hparams(swept, {f"hparam/{k}_{monitor}": result.get(f"{k}_{monitor}") for k in ("final", "best")})
        result.update(final)
    finally:
        log.close()
    return reported, result


def finish(rank: Rank, trainer: Trainer, reported: nn.Module, result: dict[str, Any], wall: float) -> None:
    """Save the model (``train.save_model``) and write ``summary.json`` (rank 0)."""
    cfg, comm, run_dir = rank.cfg, rank.comm, rank.run_dir
    if comm.rank == 0:
        rank.checkpointer.fence.check("the model and summary.json")
        if cfg.train.save_model != "none":
            save_model(reported.state_dict(), run_dir / MODEL)
    if cfg.train.save_model == "all":
        save_model(trainer.model.state_dict(), rank_model(run_dir, comm.rank))
    if comm.rank != 0:
        return
    model = trainer.model
    fields = {
        **read_json(run_dir / IDENTITY),
        "rule": option_name(type(cfg.rule)),
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "data": cfg.data.name(),
        "task": option_name(type(cfg.task)),
        "devices": cfg.devices,
        "world_size": comm.size,
        "resumed_from_step": rank.entry["step"] if rank.entry else None,
        "straggler": cfg.simulate.record(),
        "assignment": "static" if trainer.dealer is None else "dynamic",
        "checkpoint": rank.checkpointer.latest,
        "versions": rank.env,
        "topology": rank.topology,
        **result,
        "worker_wall_time_s": wall,
    }
    write_summary(run_dir, "preempted" if trainer.preempted else "ok", **fields)


def lost_after_summary(world: mpi.Comm, trainer: Trainer, result: dict[str, Any]) -> bool:
    """Fault tolerance, after :func:`finish`: whether a worker was lost before the job's last meeting.

    Collective over all ranks, servers too. If one was, summary.json must be written again.

    Rank 0 writes it after the last collective of training; a rank killed then is in no record, and if it
    was rank 0 it takes the run's results with it while the survivors, who saw no loss, end as if all were
    well. So every rank meets once more after it; those lost are recorded (``lost at step N, after
    training``), ``result`` takes them, and rank 0 of the survivors (the lowest) writes the summary again."""
    lost = world.fault_barrier()
    assert trainer.recovery is not None
    lost = [i for i in lost if i not in trainer.recovery.server_ids]  # (a server has served its last)
    if not lost:
        return False
    trainer.recovery.lost_at_end(trainer.survivors, lost, result["steps"])
    result.update(trainer.recovery.summary())
    return True


def main(argv: list[str] | None = None) -> None:
    """Run one rank of the job whose run folder is ``argv[0]``; a failure aborts the job with its status."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--joined"):
        raise SystemExit("usage: mpirun ... python -m runner.rank.worker RUN_DIR [--joined FIRST_ID]")
    run_dir, joined = Path(argv[0]), len(argv) == 3
    dynamo.defer()  # eager training needs none of it: a second less before the first step
    comm = mpi.join(int(argv[2])) if joined else mpi.init()
    me = comm.launch_rank()  # a spawned worker's id in the job (its logs are named by it)
    log_file, terminal = redirect_output(run_dir, me)
    beat = Heartbeat(run_dir, me, counter=lambda: comm.stats.seconds)
    try:
        cfg = load(str(run_dir / CONFIG))
        if cfg.hardware.cuda_aware is not None:
            comm.cuda_aware = cfg.hardware.cuda_aware
        if cfg.hardware.spares and not joined:
            comm, joined = with_spares(cfg, comm, beat)
            if comm is None:
                beat.close()
                leave(f"rank {me}: a spare, released: the job ended without needing it", log_file)
        run(cfg, run_dir, comm, (log_file, terminal), beat, joined)
        if comm.spares is not None and comm.rank == 0:
            spares.release(comm.spares)
    except Partitioned as err:
        beat.close()
        stop_partitioned(err, run_dir, me, log_file)
    except NotJoined as err:
        beat.close()
        leave(f"rank {me} stopped: {err}", log_file)
    except BaseException as err:
        fail(err, run_dir, me, log_file)
        raise
    finally:
        beat.close()
    sys.stdout.flush()
    sys.stderr.flush()
    if comm.grown:  # workers were spawned: every rank is done writing before any leaves (without
        comm.fault_barrier()  # MPI_Finalize, seen to crash then; the launcher knows this exit status)
    elif not comm.tolerant:  # after a lost rank, ULFM's MPI_Finalize was seen to hang: skip it
        mpi.finalize()
    log_file.flush()
    # Everything is written and closed: leave without the interpreter's teardown, which with torch loaded
    # takes about a second (benchmarks/README.md, start-up).
    os._exit(0)


def with_spares(cfg: Config, launch: mpi.Comm, beat: Heartbeat) -> tuple[mpi.Comm | None, bool]:
    """Collective over the launch (``hardware.spares``): the job's world, and whether this rank joined it.

    A member gets the world of the members; a spare waits (:func:`stand_by`) and gets the world it was
    promoted into, or None when the job ended without it."""
    members, pool = spares.split_launch(launch._c, cfg.hardware.spares)
    if members is None:
        return stand_by(cfg.hardware, launch, pool, beat), True
    world = mpi.Comm(members, launch.cuda_aware, launch.stats)
    world.spares = pool
    return world, False


def stop_partitioned(err: Partitioned, run_dir: Path, rank: int, log_file: TextIO) -> None:
    """Leave on the minority side of a partition.

    The reason goes in ``logs/rank<r>.partitioned`` and the rank's log, nothing else is written, and there
    is no MPI_Abort (the majority goes on; an error file would end its job)."""
    try:
        write_text(rank_file(run_dir, rank, PARTITIONED), f"{err}\n")  # (never through a link)
    except OSError:
        pass
    leave(f"rank {rank} stopped: {err}", log_file)


def leave(why: str, log_file: TextIO) -> None:
    """Leave the job that goes on without this rank: ``why`` to its log, no error file, no MPI_Abort."""
    print(why, file=sys.stderr, flush=True)  # to its log too
    log_file.flush()
    sys.stdout.flush()
    os._exit(0)  # not an error: under ULFM a non-zero exit could make mpirun end the side that goes on


def fail(err: BaseException, run_dir: Path, rank: int, log_file: TextIO) -> None:
    """Name the failure and abort the job with its status: 3 diverged, a SystemExit's own code, else 1.

    The failure is named in ``logs/rank<r>.error``, the rank's log and stderr."""
    log_file.write(traceback.format_exc())
    if isinstance(err, Diverged):
        status = EXIT["diverged"]
    elif isinstance(err, SystemExit) and isinstance(err.code, int) and err.code:
        status = err.code
    else:
        status = EXIT["failed"]
    end_job(run_dir, rank, root_cause(err), status, traceback.format_exc())


if __name__ == "__main__":
    main()
