"""A model whose process kills itself (SIGKILL, as the OOM killer would) at one training forward call on one
rank, to test ``hardware.fault_tolerance=continue``.

Selected with ``hydra.searchpath=[file://tests/conf]`` and ``model=dies model.die_rank=2 model.die_at=30``.
``model.die_after_val=N`` kills it instead at its N-th training forward call after its first validation
pass (a forward call in eval mode, of this model or a copy of it: the servers' or the center's model).
``model.val_marker=PATH`` kills it as soon as another worker validated, wherever it is then (a thread
watches for the file, which the ranks other than ``die_rank`` and 0 create when they validate, as a worker
that validates alone and sends worker 0 its results does); ``model.hold_rank=0 model.hold_s=1`` then has
rank 0 sleep a second at its first training forward call after the file appeared (the results it was sent
wait for it meanwhile). ``model.die_at_val=N model.die_delay_s=S`` kills it ``S`` seconds after its N-th
validation pass began (a thread's timer, wherever the process is then: within the validation's collectives,
the epoch's records, or the next epoch), as a ``kill -9`` at a validation line does; with ``die_at``, the
delay instead runs from that training forward call (wherever the step, a validation or a checkpoint is
then). ``model.also_rank=R`` has launch rank R die at the same moment (two workers lost at once);
``model.join_rank=R model.join_delay_s=S`` has rank R die S seconds into the job's first growth (while a
replacement joins), or as its growth ends if that is sooner (a quick spawn: the loss still comes while
the others merge, never after the run). A worker spawned into the job (``--joined``) never dies.
With warm spares (``hardware.spares``) it dies likewise in their first promotion.
``model.merge_fails_rank=R`` has rank R's merge of the job's first growth fail (``MPI_ERR_INTERN``).
``model.die_in=barrier model.die_in_call=K`` (with ``die_delay_s``) kills it instead that long after it
entered its K-th call of that method of the communicator (:class:`runner.comm.mpi.Comm`), while it waits
there for the others: a collective it has entered, which the others may complete without it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.models.cnn import CNNConfig

#: Whether this process ran a forward call in eval mode (a validation); shared by the model's copies.
_validated = [False]
#: Validation passes begun in this process (an eval-mode forward call after a training one, or the first).
_passes = [0]
#: Whether the last forward call of this process (any copy of the model) was in training mode.
_last_training = [True]


def launch_rank() -> int:
    """This process's launch rank; -1 for a worker spawned into the job (a replacement lives on: its own
    world numbers it from 0, as if it were rank 0 of the launch)."""
    if "--joined" in sys.argv:
        return -1
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", -1))


class Dies(torch.nn.Module):
    """Wraps a model; its ``at``-th training forward call on launch rank ``rank`` kills the process (with
    ``after_val`` > 0: its ``after_val``-th training forward call after its first validation; with
    ``marker``: as soon as that file exists, made by another worker's validation; ``hold``: rank
    ``hold[0]`` then sleeps ``hold[1]`` seconds once, at a training forward call)."""

    def __init__(
        self,
        inner: torch.nn.Module,
        rank: int,
        at: int,
        after_val: int = 0,
        marker: str | None = None,
        hold: tuple[int, float] = (-1, 0.0),
        at_val: tuple[int, float] = (0, 0.0),
        in_call: tuple[str | None, int] = (None, 0),
        also: int = -2,
        join: tuple[int, float] = (-1, 0.0),
    ):
        super().__init__()
        self.inner, self.rank, self.at, self.after_val = inner, rank, at, after_val
        self.marker = Path(marker) if marker else None
        self.hold = hold  # (launch rank, seconds): that rank sleeps once, when the marker appeared
        self.at_val = at_val  # (N, seconds): on launch rank ``rank``, die that long after validation N began
        self.calls = self.calls_after_val = 0
        self.ranks = {rank, also}  # the launch ranks that die (``also``: a second one, at the same moment)
        if self.marker is not None and launch_rank() in self.ranks:
            die_on(self.marker)
        if in_call[0] and launch_rank() in self.ranks:
            die_in_call(in_call[0], in_call[1], at_val[1])
        if join[0] >= 0 and launch_rank() == join[0]:
            die_in_call("grow", 1, join[1], by_return=True)
            die_in_promotion(join[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            _validated[0] = True
            if _last_training[0]:
                _passes[0] += 1
                if self.at_val[0] and _passes[0] == self.at_val[0] and launch_rank() in self.ranks:
                    die_later(self.at_val[1])
            if self.marker is not None and launch_rank() not in (self.rank, 0):
                self.marker.touch()
        elif not os.environ.get("MPITRAIN_TEST_NO_DIE"):  # (set: a resumed run lives on)
            self.calls += 1
            self.calls_after_val += _validated[0]
            if self.marker is not None and self.hold[0] == launch_rank() and self.marker.exists():
                time.sleep(self.hold[1])
                self.hold = (-1, 0.0)
            due = self.calls_after_val == self.after_val if self.after_val else self.calls == self.at
            if due and launch_rank() in self.ranks and self.at_val[1] and not self.at_val[0]:
                die_later(self.at_val[1])  # wherever this step, or what follows it, is then
            elif due and launch_rank() in self.ranks:
                die()
        _last_training[0] = self.training
        return self.inner(x)


def die() -> None:
    stamp = os.environ.get("MPITRAIN_KILL_STAMP")  # benchmarks/fault_tolerance.py: when
    if stamp:
        with open(stamp, "a") as f:  # one line per kill
            f.write(f"{time.time()!r}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def die_on(marker: Path) -> None:
    """Kill this process as soon as ``marker`` exists (a daemon thread polls for it every 2 ms)."""

    def watch() -> None:
        while not marker.exists():
            time.sleep(0.002)
        die()

    if not os.environ.get("MPITRAIN_TEST_NO_DIE"):
        threading.Thread(target=watch, daemon=True).start()


def die_later(seconds: float) -> None:
    """Kill this process ``seconds`` from now, wherever it is then (a daemon thread's timer)."""
    if not os.environ.get("MPITRAIN_TEST_NO_DIE"):
        timer = threading.Timer(seconds, die)
        timer.daemon = True
        timer.start()


def die_in_call(method: str, k: int, seconds: float, by_return: bool = False) -> None:
    """Kill this process ``seconds`` after it entered its ``k``-th call of ``Comm.<method>`` (``by_return``:
    or as that call returns, if sooner); ``summary``: as it is about to write summary.json (after the last
    collective of training: the writer's last task)."""
    from runner.comm.mpi import Comm

    if method == "summary":  # (the worker runs as ``python -m runner.rank.worker``: its module is __main__)
        for name in ("__main__", "runner.rank.worker"):
            if hasattr(module := sys.modules.get(name), "write_summary"):
                module.write_summary = lambda *args, **kwargs: die()
        return

    if hasattr(Comm, f"_dies_{method}"):  # (the model is built again: patched once)
        return
    real, calls = getattr(Comm, method), [0]
    setattr(Comm, f"_dies_{method}", real)

    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            die_later(seconds)
        result = real(self, *args, **kwargs)
        if calls[0] == k and by_return and not os.environ.get("MPITRAIN_TEST_NO_DIE"):
            die()  # (still alive: the call ended before the timer)
        return result

    setattr(Comm, method, wrapped)


def die_in_promotion(seconds: float) -> None:
    """Kill this process ``seconds`` into the job's first promotion of spares (``hardware.spares``), or as
    its reform of the pool returns, if sooner: the loss comes while the spare settles in."""
    from runner.comm import spares

    real = spares.reform
    if getattr(real, "dies", False):
        return

    def wrapped(*args, **kwargs):
        die_later(seconds)
        result = real(*args, **kwargs)
        die()
        return result

    wrapped.dies = True  # type: ignore[attr-defined]
    spares.reform = wrapped


def fail_merge() -> None:
    """This rank's first merge of a growth raises ``MPI_ERR_INTERN`` (as one was seen to in CI)."""
    from runner.comm import membership
    from runner.comm.binding import MPI

    if hasattr(membership, "_real_merge"):  # (the model is built again: patched once)
        return
    real = membership._real_merge = membership.merge_intercomm
    calls = [0]

    def merge(inter):
        calls[0] += 1
        if calls[0] > 1:
            return real(inter)
        raise MPI.Exception(MPI.ERR_INTERN)

    membership.merge_intercomm = merge


@dataclass
class DiesCNNConfig(CNNConfig):
    die_rank: int = 2
    die_at: int = 30  # training forward calls of that rank
    die_after_val: int = 0  # N > 0 instead: its N-th training forward call after a validation
    val_marker: str | None = None  # a file: die as soon as another worker (not 0) validated
    hold_rank: int = -1  # with val_marker: this rank sleeps hold_s once, at its first step after it appeared
    hold_s: float = 0.0
    die_at_val: int = 0  # N > 0 instead: die die_delay_s seconds after its N-th validation pass began
    die_delay_s: float = 0.0
    die_in: str | None = None  # instead: die die_delay_s seconds into this method's die_in_call-th call
    die_in_call: int = 1  # (die_in=summary: as it is about to write summary.json)
    also_rank: int = -2  # a second launch rank that dies at the same moment (two workers lost at once)
    join_rank: int = -1  # a launch rank that dies join_delay_s into the job's first growth (a replacement's)
    join_delay_s: float = 0.0
    merge_fails_rank: int = -1  # a launch rank whose merge of the job's first growth fails (MPI_ERR_INTERN)

    def build(self) -> torch.nn.Module:
        if self.merge_fails_rank >= 0 and launch_rank() == self.merge_fails_rank:
            fail_merge()
        hold, at_val = (self.hold_rank, self.hold_s), (self.die_at_val, self.die_delay_s)
        in_call, join = (self.die_in, self.die_in_call), (self.join_rank, self.join_delay_s)
        when = (self.die_at, self.die_after_val, self.val_marker, hold, at_val, in_call, self.also_rank, join)
        return Dies(super().build(), self.die_rank, *when)
