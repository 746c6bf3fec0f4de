"""Going on when workers die (``hardware.fault_tolerance=continue``), on MPI's ULFM.

A lost worker surfaces as :class:`~runner.comm.PeerLost` in whatever communication call a survivor is
making: the gradient all-reduce, a gossip push, the stop/checkpoint agreement, a validation sum. That
survivor revokes the workers' communicator, so every other survivor's next (or pending) call fails too and
all of them come here, wherever they were. Then, collectively over the survivors (:meth:`Recovery.recover`):

1. the rule abandons what it had in flight, and the communicator is shrunk to the survivors (ranks
   renumbered in order: the lowest survivor is the new rank 0 and takes over the run's records);
2. synchronous rules agree on the step to continue from. A survivor whose step's collective completed
   (``done`` = the steps it applied) is ahead of one whose collective failed, by one step or, under rules
   whose steps between exchanges are local, two; the one behind takes the whole state (model, optimizer,
   rule, position) of the lowest survivor ahead, so no step is half-applied, and passes over the batches
   it did not train (``Trainer.train_span``). If none is ahead, the step in flight is redone by every
   survivor on the same batch (BatchNorm statistics restored first), now over the survivors. Asynchronous
   rules keep each worker's own position;
3. the rule continues by its own math (``Rule.recover``); the validation data is split among the survivors
   at once, the training data from the next epoch (this epoch, each survivor finishes its own shard and the
   lost worker's remaining batches are not trained on: re-dealing them mid-epoch would change the batches
   every survivor sees and give some samples twice);
4. the next stop/checkpoint agreement step is agreed, and a checkpoint of the recovered state is taken
   there; the failure is recorded (``metrics.jsonl``, ``summary.json``, the console and ``logs/lost.json``,
   which tells the launcher's watchdog not to wait for the lost rank).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from runner.comm.errors import PeerLost
from runner.rank.fence import Fence, Partitioned, quorum
from runner.rank.resilience.elastic import SPAWN_GRACE_S, stuck_in_spawn
from runner.rank.state import Position
from runner.run_folder import LOGS, LOST, dumps, write_atomic

if TYPE_CHECKING:
    from runner.comm import Comm
    from runner.rank.resilience.elastic import Elastic


class Survivor(Protocol):
    """What recovery asks of the training loop (:class:`~runner.rank.resilience.survivor.Survivors`)."""

    @property
    def synchronous(self) -> bool:
        """Whether the rule's workers step together (then they agree on one step to continue from)."""

    def abandon(self) -> None:
        """Complete or forget the rule's communication in flight (the communicator is revoked)."""

    def save(self, pos: Position, end: bool) -> None:
        """Checkpoint (collective over the workers)."""

    def share_state(self, comm: Comm, root: int) -> Any:
        """Give every survivor ``root``'s model, and return ``root``'s optimizer, rule and scaler states."""

    def adopt(self, state: Any) -> None:
        """Take the states :meth:`share_state` returned (this survivor was behind)."""

    def rejoin(self, val_loader: Any, next_poll: int, before: list[int], lost: list[int]) -> None:
        """Go on over the survivors: the rule's own recovery, the validation share and the next agreement.

        With dynamic assignment the lost workers' data goes back to the pool too. ``before``: the workers'
        launch ranks before the loss, ``lost``: the lost ones'."""

    def agreement_after(self, step: int) -> int:
        """The first step after ``step`` at which the workers agree on checkpoints and stops."""

    def joins_agreed(self) -> int:
        """The workers ``RUN_DIR/JOIN`` asked for that the workers agreed to add and have not added yet."""

    def put_off_growth(self, joins: int) -> None:
        """A growth agreed and not under way waits for the agreement the recovery forces.

        ``joins``: the most :meth:`joins_agreed` of any survivor."""

    def record_failure(self, step: int, lost: list[int], seconds: float, line: str, terminal: TextIO) -> None:
        """Record the loss in the run's records and on the console (the new rank 0 takes them over)."""


@dataclass
class Steps:
    """The steps a survivor's state has applied (``done``), and whether it took them from another."""

    done: int
    adopted: bool = False


class TooFewWorkers(RuntimeError):
    """Fewer workers survive than ``hardware.min_workers``: the job ends after a checkpoint."""


class ServerLost(RuntimeError):
    """A server rank died: it held state no other rank has, so the job ends with the last checkpoint."""


class Recovery:
    """The survivors' side of fault tolerance for one worker: detect, shrink, agree, continue, record.

    ``servers``: the rule's server ranks, the last ones of ``world``; ``val_loader(rank, size)`` makes the
    loader of a share of the validation data; ``hosts``: every rank's host, by id; ``elastic``: the job may
    grow (:mod:`runner.rank.resilience.elastic`), and with ``heal`` a lost worker is replaced at the next
    agreement."""

    def __init__(
        self,
        workers: Comm,
        world: Comm,
        servers: int,
        run_dir: Path,
        min_workers: int,
        terminal: TextIO,
        val_loader: Callable[[int, int], Any],
        hosts: list[str],
        elastic: Elastic | None = None,
        heal: bool = False,
        fence: Fence | None = None,
    ):
        self.workers, self.world, self.servers, self.run_dir = workers, world, servers, run_dir
        self.min_workers, self.terminal, self.val_loader = min_workers, terminal, val_loader
        self.hosts, self.elastic, self.heal = hosts, elastic, heal
        self.fence = fence or Fence(run_dir, enabled=False)
        self.failures: list[dict[str, Any]] = []
        #: The servers' ids: a job-wide barrier (a checkpoint's) drops a lost one from ``world`` unnamed.
        self.server_ids = [world.launch_rank(r) for r in range(world.size - servers, world.size)]
        self.seconds = 0.0
        self.heal_pending = 0  # lost workers to replace at the next agreement (heal)
        self.heal_hosts: list[str] = []  # where they ran

    def recover(self, trainer: Survivor, pos: Position, holding: bool, applied: bool) -> bool:
        """Collective over the surviving workers.

        ``holding``: the failure came inside a step, on a batch this rank had not finished (``applied``: its
        optimizer step was taken). Returns True when that batch counts as done, False when it must be redone.

        A worker lost during the recovery itself (two lost at once, noticed one after the other) makes its
        collectives fail: the survivors recover again, over the fewer, from the shrink on."""
        start = time.time()
        self.check_servers(pos.step)
        before = [self.workers.launch_rank(r) for r in range(self.workers.size)]
        self.workers.revoke()
        trainer.abandon()
        lost: list[int] = []
        steps = Steps(pos.step + int(holding and applied))
        while True:
            lost += self.shrink()
            if not lost:
                raise RuntimeError(
                    "a communication call failed on a worker although no worker was lost (see the ranks' "
                    "logs)"
                ) from None
            try:
                self._go_on(trainer, pos, holding, steps, before, lost)
                self.workers.agree()  # all leave the recovery, or all do it again (one saw a new loss)
                break
            except PeerLost:
                self.check_servers(pos.step)
                self.workers.revoke()
        seconds = time.time() - start
        self.seconds += seconds
        self._record(trainer, lost, pos.step, start, seconds)
        if self.heal:
            replaced = self._to_replace(lost, pos.step)
            self.heal_pending += len(replaced)
            self.heal_hosts += [self.hosts[r] for r in replaced]
        return steps.adopted or applied

    def _go_on(
        self, trainer: Survivor, pos: Position, holding: bool, steps: Steps, before: list[int], lost: list
    ) -> None:
        """Collective over the survivors, once shrunk: go on or stop, agree on the step, and rejoin.

        They stop on a partition or with too few workers; the step is agreed under synchronous rules."""
        self._go_on_or_stop(before)
        if trainer.synchronous and (took := self._agree(trainer, pos, holding, steps.done)) is not None:
            steps.done, steps.adopted = took, True  # (kept if the survivors recover again)
        if self.workers.size < self.min_workers:
            if trainer.synchronous:  # asynchronous workers stand at different steps: the last one stays
                trainer.save(pos, False)
            raise TooFewWorkers(
                f"{self.workers.size} worker(s) left after losing rank(s) {lost}, fewer than "
                f"hardware.min_workers={self.min_workers}; the job ends, resume=RUN_DIR continues it from "
                "its last checkpoint"
            ) from None
        wanted = [trainer.agreement_after(pos.step), trainer.joins_agreed()]
        next_poll, joins = self.workers.allreduce_values(wanted, "max")
        trainer.rejoin(self.val_loader(self.workers.rank, self.workers.size), int(next_poll), before, lost)
        trainer.put_off_growth(int(joins))

    def shrink(self) -> list[int]:
        """Shrink the workers' communicator to the survivors; the lost ones' ids.

        A worker lost while the job grew may leave another rank waiting in ``MPI_Comm_spawn`` for good (ULFM
        does not interrupt it; seen when the spawn failed on some ranks and not on others), and this shrink
        with it: past :data:`~runner.rank.resilience.elastic.SPAWN_GRACE_S` the job ends with that cause
        named instead of stalling."""
        if self.elastic is None or not self.elastic.spawning:
            return self.workers.shrink()
        lost = ", ".join(f"rank {i} ({self.hosts[i]})" for i in self.workers.lost_peers_ids())
        me = self.world.launch_rank()
        timer = threading.Timer(SPAWN_GRACE_S, stuck_in_spawn, (self.run_dir, me, lost or "a worker"))
        timer.daemon = True
        timer.start()
        try:
            return self.workers.shrink()
        finally:
            timer.cancel()
            self.elastic.spawning = False

    def lost_at_end(self, trainer: Survivor, lost: list[int], step: int) -> None:
        """Collective over the survivors after training: record the workers lost in the job's closing barrier.

        ``lost``: ids; the world is shrunk already, the workers' communicator is shrunk here. Recorded so
        that the summary counts them."""
        self.check_servers(step)
        if not lost:
            return
        if self.workers is not self.world:
            self.workers.shrink()
        self._record(trainer, lost, step, time.time(), 0.0, "after training")

    def _go_on_or_stop(self, before: list[int]) -> None:
        """Collective over the survivors: raise :class:`Partitioned` unless they are the side that goes on.

        They go on when they are the side of a possible partition that goes on
        (:func:`runner.rank.fence.quorum`) and their rank 0 claims the run folder's next membership
        generation first."""
        survivors = [self.workers.launch_rank(r) for r in range(self.workers.size)]
        # a replacement not yet welcomed never trained: its loss (or its leaving, when a loss cut its spawn
        # short) says nothing of a partition, and counted it made two survivors of four "exactly half"
        arriving = set(self.elastic.arriving) if self.elastic is not None else set()
        members = [r for r in before if r not in arriving]
        why = quorum(members, [r for r in survivors if r not in arriving], self.hosts)
        if why is not None:
            raise Partitioned(why) from None
        claimed = None
        if self.workers.rank == 0:
            claimed = self.fence.claim_next([f"{r}@{self.hosts[r]}" for r in survivors])
        claimed = self.workers.broadcast_object(claimed, root=0)
        if not claimed:
            raise Partitioned(
                f"partitioned: another side claimed the run folder's membership generation "
                f"{self.fence.generation + 1} first; this side ({len(survivors)} workers) stops without a "
                "checkpoint"
            ) from None
        self.fence.generation = claimed

    def _to_replace(self, lost: list[int], step: int) -> list[int]:
        """Those of ``lost`` to replace (heal).

        Not a replacement that died before it trained (it joined at this step or the one before), which
        would be spawned again and again; worker 0 says so."""
        joined = {j["rank"]: j["step"] for j in (self.elastic.joins if self.elastic is not None else [])}
        early = [r for r in lost if r in joined and joined[r] >= step - 1]
        if early and self.workers.rank == 0:
            names = ", ".join(f"rank {r}" for r in early)
            print(f"warning: {names} died right after joining (step {step}): not replaced again", flush=True)
        # (a replacement lost before it was welcomed: the loss it replaced is still to replace, once)
        arriving = self.elastic.arriving if self.elastic is not None else []
        return [r for r in lost if r not in early and r not in arriving]

    def check_servers(self, step: int) -> None:
        """Raise :class:`ServerLost` naming a lost server (its part of the state is nowhere else).

        Lost: failed in ``world``, or no longer in it (a job-wide barrier goes on without it)."""
        if self.servers == 0:
            return
        failed = {self.world.launch_rank(r) for r in self.world.lost_peers()}
        present = {self.world.launch_rank(r) for r in range(self.world.size)}
        dead = [i for i in self.server_ids if i in failed or i not in present]
        if dead:
            names = ", ".join(f"{i} ({self.hosts[i]})" for i in dead)
            raise ServerLost(
                f"server rank {names} was lost at step {step}: it held state no other rank has, so the "
                "job ends; resume=RUN_DIR continues from the last checkpoint"
            ) from None

    def _agree(self, trainer: Survivor, pos: Position, holding: bool, done: int) -> int | None:
        """Bring every survivor to the state of the most advanced one (``done``: steps applied).

        Returns the steps of the state this one took, if it took one (the loop then counts a held batch as
        a step)."""
        w = self.workers
        top = int(w.allreduce_values([done], "max")[0])
        if not w.allreduce_values([float(done != top)], "max")[0]:
            return None
        src = int(w.allreduce_values([w.rank if done == top else w.size], "min")[0])
        state = trainer.share_state(w, src)
        where = w.broadcast_object((top, pos.epoch, pos.batch + top - pos.step), root=src)
        if done == top:
            return None
        trainer.adopt(state)
        pos.step, pos.epoch, pos.batch = where
        if holding:
            pos.step, pos.batch = pos.step - 1, pos.batch - 1
        return top

    def _record(
        self, trainer: Survivor, lost: list[int], step: int, when: float, seconds: float, then: str = ""
    ) -> None:
        for rank in lost:
            self.failures.append(
                {"rank": rank, "host": self.hosts[rank], "step": step, "time": when, "cause": LOST_CAUSE}
            )
        if self.workers.rank != 0:
            return
        ranks = ", ".join(f"rank {r} ({self.hosts[r]})" for r in lost)
        if then:  # (the job ends: nothing to continue)
            line = f"{ranks} lost at step {step}, {then}; {self.workers.size} workers at the end"
        else:
            then = "; a replacement joins at the next agreement" if self.heal else ""
            line = (
                f"{ranks} lost at step {step}; continuing with {self.workers.size} workers "
                f"(recovered in {seconds:.2f} s){then}"
            )
        trainer.record_failure(step, lost, seconds, line, self.terminal)
        lost_all = sorted({f["rank"] for f in self.failures})
        self.fence.check(str(self.run_dir / LOGS / LOST))
        write_atomic(self.run_dir / LOGS / LOST, dumps({"lost": lost_all}))

    def summary(self) -> dict[str, Any]:
        """The fields summary.json gets."""
        return {
            "failures": self.failures,
            "joins": self.elastic.joins if self.elastic is not None else [],
            "spawned": self.world.grown,
            "workers_at_end": self.workers.size,
            "recovery_time_s": self.seconds,
        }


#: What the survivors know of a lost rank's end: nothing (a rank that fails with an error ends the job).
LOST_CAUSE = (
    "the process ended without an error of its own: killed (kill -9, the OOM killer) or its node lost"
)
