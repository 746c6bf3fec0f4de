"""A whole job in one process, whose ranks die at any communication call: the worker's own code, in threads.

:func:`job` runs every rank of a ``hardware.fault_tolerance=continue`` job as a thread of a
:class:`~tests.helpers.lossy.LossyWorld`, each through ``runner.rank.worker``'s functions (``build``,
``fit``, ``serve``: the trainer, recovery, the agreement, the rule and its servers as a real job builds
them), skipping only what needs a process (binding, the launcher, MPI itself). A tiny MLP on a small
synthetic set keeps a job under a second or two. ``deaths`` ({launch rank: call number}) kills ranks at
those calls (:class:`~tests.helpers.lossy.Killed`); :func:`calls` counts a job's calls without deaths, so
a test can draw a call from the whole run.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from runner.rank.assembly import Rank, build, build_model
from runner.rank.checkpoint import Checkpointer
from runner.rank.worker import fit, lost_after_summary, serve
from runner.rules.base import split_roles
from runner.run_folder import LOGS
from tests.conftest import checked_config
from tests.helpers.lossy import Killed, LossyWorld

WORKERS = 4
#: A job of 2 epochs of 8 steps per worker (4 workers, 256 samples, batches of 8), validated each epoch.
JOB = (
    "model=mlp",
    "model.hidden=[16]",
    "data=synthetic",
    "data.shape=[8]",
    "data.num_classes=4",
    "data.train_size=256",
    "data.val_size=64",
    "train.batch_size=8",
    "train.epochs=2",
    f"devices={WORKERS}",
    "hardware.fault_tolerance=continue",
    "train.progress=false",
    "checkpoint.every=null",
)


def config(rule: list[str]) -> Any:
    """The job's checked config for a rule's overrides."""
    return checked_config([*JOB, *rule])


def rank_main(comm: Any, cfg: Any, run_dir: Path) -> dict[str, Any] | None:
    """One rank, as ``runner.rank.worker.run`` does it after placement: a server serves, a worker trains
    and meets the others once more at the end."""
    hosts = ["local"] * comm.size
    workers = split_roles(comm, cfg.rule.extra_ranks())
    streams = (io.StringIO(), io.StringIO())
    beat = SimpleNamespace(progress=lambda step=None: None, set_role=lambda role: None, seconds=0.0)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, comm, None, servers=cfg.rule.extra_ranks())
    device = torch.device("cpu")
    rank = Rank(cfg, run_dir, comm, workers, device, hosts, None, None, checkpointer, streams, beat, {}, {})
    model = build_model(rank)
    if workers is None:
        serve(rank, model)
        return None
    trainer, epochs, steps = build(rank, model)
    comm.barrier()  # every rank is past the start-up collectives (as run() does under fault tolerance)
    comm._w.started[comm.launch_rank()] = comm._w.calls[comm.launch_rank()]  # (those are not survived)
    _, result = fit(rank, trainer, epochs, steps)
    lost_after_summary(comm, trainer, result)  # the last meeting, after summary.json (not written here)
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    return {"result": result, "params": params, "worker": workers.rank, "console": streams[1].getvalue()}


def job(cfg: Any, run_dir: Path, deaths: dict[int, int] | None = None, timeout: float = 60) -> tuple:
    """Run the job; returns (each rank's :func:`rank_main` result or :class:`Killed`, the world)."""
    (run_dir / LOGS).mkdir(parents=True, exist_ok=True)  # (the launcher makes it)
    world = LossyWorld(cfg.world_size, deaths, timeout=timeout)
    return world.run(lambda comm: rank_main(comm, cfg, run_dir)), world


def calls(cfg: Any, run_dir: Path) -> dict[int, range]:
    """Each worker's communication calls in a job without deaths, after its start-up (by launch rank): a
    death drawn among them lands in training, a validation, a checkpoint or the job's end."""
    _, world = job(cfg, run_dir)
    return {r: range(world.started[r] + 1, world.calls[r] + 1) for r in sorted(world.started)}


__all__ = ["JOB", "WORKERS", "Killed", "calls", "config", "job"]
