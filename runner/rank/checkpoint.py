"""Checkpoints of a whole job, and the workers' agreement on when to take one or to stop.

Layout of a run folder::

    checkpoints/00003-step120/rank0.pt ... rank<N-1>.pt  the 3rd checkpoint, after step 120: one file per
                                                         rank (workers and servers)
    checkpoints/checkpoint.json                          the index: complete checkpoints, newest last
    STOP                                                 the launcher's request to checkpoint and stop

Every rank writes its own part (``torch.save`` to a temporary file, then ``os.replace``); all ranks then
meet in a barrier, and only then rank 0 adds the checkpoint to the index (also replaced atomically) and
removes the oldest beyond ``checkpoint.keep``. So the index only ever names complete checkpoints, and the
previous one stays until the new one is complete. A part holds only tensors, numbers, strings, lists and
dicts, so ``torch.load(..., weights_only=True)`` reads it. torch and numpy are imported where used: the
launcher reads the index and the file names from here.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.lazy import lazy_import
from runner.run_folder import (
    CHECKPOINT_INDEX,
    CHECKPOINTS,
    STOP,
    checkpoint_part,
    dumps,
    read_checkpoint_index,
    write_atomic,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from runner.comm import Comm
    from runner.schema.sections import CheckpointConfig
else:
    np, torch = lazy_import("numpy"), lazy_import("torch")


def rng_state() -> dict[str, Any]:
    """Every random generator a rank uses: torch (CPU and CUDA), numpy and Python's."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "python": list(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file, so ``path`` is either absent or complete."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"cannot write {path}: {err.strerror}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def latest_checkpoint(run_dir: Path, world_size: int) -> dict[str, Any] | None:
    """The newest complete checkpoint of ``run_dir``, checked against this job's number of ranks."""
    entries = read_checkpoint_index(run_dir)
    if not entries:
        return None
    entry = entries[-1]
    if entry["world_size"] != world_size:
        raise ValueError(
            f"{run_dir}: its checkpoint {entry['dir']} was written by {entry['world_size']} ranks, this job "
            f"has {world_size}; resume with the run's own devices and rule"
        )
    return entry


def load_part(run_dir: Path, entry: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's part of the checkpoint ``entry`` (an item of ``read_checkpoint_index``)."""
    path = checkpoint_part(run_dir, entry["dir"], rank)
    if not path.exists():
        raise FileNotFoundError(f"{path}: the checkpoint has no part for rank {rank}")
    return torch.load(path, map_location="cpu", weights_only=True)


class Checkpointer:
    """Writes this rank's part of a checkpoint; collective over every rank of the job (``world``)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, world: Comm, resumed: dict[str, Any] | None):
        self.cfg, self.world = cfg, world
        self.root = run_dir / CHECKPOINTS
        self.root.mkdir(exist_ok=True)
        self.last_time = time.time()
        self.count = resumed["seq"] if resumed else 0
        self.latest: str | None = resumed["dir"] if resumed else None

    def due(self, step: int) -> bool:
        """Whether the step count alone asks for a checkpoint after ``step`` steps (the same on all ranks)."""
        return self.cfg.every is not None and step % self.cfg.every == 0

    def due_between(self, before: int, after: int) -> bool:
        """Whether the step count asks for a checkpoint between ``before`` and ``after`` steps (dynamic
        assignment: the run's chunks per worker at two meetings)."""
        every = self.cfg.every
        return every is not None and after // every > before // every

    def time_due(self) -> bool:
        minutes = self.cfg.every_minutes
        return minutes is not None and time.time() - self.last_time >= 60 * minutes

    def save(self, step: int, part: dict[str, Any], info: dict[str, Any] | None = None) -> None:
        """Write this rank's ``part`` of the job's next checkpoint, taken after ``step`` steps; once every
        rank has written, rank 0 indexes it with ``info``. Every rank saves the same sequence of
        checkpoints, so the k-th is in the same folder everywhere."""
        if self.world.tolerant:  # ranks may have died: the parts are the survivors', renumbered
            self.world.fault_barrier()
        self.count += 1
        name = f"{self.count:05d}-step{step}"
        folder = self.root / name
        folder.mkdir(exist_ok=True)
        save_atomic(part, folder / f"rank{self.world.rank}.pt")
        self.world.barrier()
        self.latest = name
        self.last_time = time.time()
        if self.world.rank != 0:
            return
        entries = read_checkpoint_index(self.root.parent)
        entries.append(
            {
                "step": step,
                "seq": self.count,
                "dir": name,
                "world_size": self.world.size,
                "time": time.time(),
                **(info or {}),
            }
        )
        write_atomic(
            self.root / CHECKPOINT_INDEX, dumps({"checkpoints": entries[-self.cfg.keep :]}, indent=1)
        )
        for old in entries[: -self.cfg.keep]:
            shutil.rmtree(self.root / old["dir"], ignore_errors=True)


@dataclass
class Decision:
    checkpoint: bool = False
    stop: bool = False


class Control:
    """The workers' agreement on when to checkpoint (time-based) or stop (``RUN_DIR/STOP``, written by the
    launcher on SIGTERM/SIGUSR1), without a blocking collective per step.

    Every ``interval`` steps each worker completes the small non-blocking all-reduce (max) started
    ``interval`` steps earlier, on a communicator of its own, and starts the next with worker 0's flags.
    The result is known to all workers at the same step, so they all act on it there. Synchronous rules
    use ``interval`` 1; asynchronous ones a longer one, so workers drift at most that many steps apart.
    """

    def __init__(
        self, workers: Comm, run_dir: Path, checkpointer: Checkpointer, interval: int, start: int = 0
    ):
        self.workers, self.stop_file = workers, run_dir / STOP
        self.checkpointer, self.interval = checkpointer, interval
        self.flags = torch.zeros(2, dtype=torch.float64)
        self.reset((start // interval + 1) * interval, forced=False)

    def reset(self, next_poll: int, forced: bool = True) -> None:
        """Start over on the workers' communicator as it is now (after workers were lost): the next
        agreement is after ``next_poll`` steps (the same on every worker), and with ``forced`` it decides
        a checkpoint there."""
        self.comm = self.workers.split(0)
        self.next_poll, self.forced = next_poll, forced
        self.request = None

    def poll(self, step: int) -> Decision:
        """Call after every step (``step`` steps done); the decision is the same on every worker."""
        if step != self.next_poll:
            return Decision()
        self.next_poll += self.interval
        decision = Decision(checkpoint=self.forced)
        self.forced = False
        if self.request is not None:
            self.request.wait()
            decision = Decision(
                checkpoint=bool(self.flags[0] > 0) or decision.checkpoint, stop=bool(self.flags[1] > 0)
            )
        if self.workers.rank == 0:
            self.flags[0] = float(self.checkpointer.time_due())
            self.flags[1] = float(self.stop_file.exists())
        else:
            self.flags.zero_()
        self.request = self.comm.iallreduce(self.flags, op="max")
        return decision

    def close(self) -> None:
        """Complete the all-reduce in flight (every worker calls this at the same step)."""
        if self.request is not None:
            self.request.wait()
            self.request = None
