"""The workers' agreement: at the same step on every worker, whether to checkpoint, stop, grow or validate.

:class:`Control` reaches it without a blocking collective per step (a small non-blocking all-reduce of
worker 0's flags, completed an interval later); :class:`Decision` is what it decides. Worker 0 reads the
launcher's requests for it: ``RUN_DIR/STOP`` (checkpoint and stop) and ``RUN_DIR/JOIN`` (add workers,
:mod:`runner.rank.join_request`). Under fault tolerance, :func:`settle` closes a run of collectives that
the workers must all leave together, or none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.lazy import lazy_import
from runner.rank.assignment import decision_slot
from runner.rank.join_request import growth_refusal, join_count, read_join, stale_join
from runner.run_folder import JOIN, STOP

if TYPE_CHECKING:
    import torch

    from runner.comm import Comm
    from runner.comm.face import CounterLike
    from runner.rank.checkpoint import Checkpointer
else:
    torch = lazy_import("torch")


def settle(workers: Comm, meet: bool = False) -> None:
    """Collective over the workers: ULFM's agreement, which all survivors leave alike (fault tolerance).

    All go on, or all raise :class:`~runner.comm.PeerLost` (a worker was lost before it). A collective that
    a lost worker had entered may complete on some survivors and fail on others; those it completed on
    would go on to what follows (the next epoch, the job-wide checkpoint barrier) while the others recover
    and do the collectives again, each waiting for the other (a stall). Ending such a run of collectives
    here makes all survivors recover here and do it again together. (``MPI_Comm_agree`` on a communicator
    another survivor revoked completes too, so they all meet in the shrink.) Without fault tolerance it
    does nothing (``meet``: a barrier)."""
    if not workers.tolerant:
        if meet:
            workers.barrier()
        return
    workers.agree()


@dataclass
class Decision:
    checkpoint: bool = False
    stop: bool = False
    join: int = 0  # workers to add (``RUN_DIR/JOIN``)
    polled: bool = False  # the workers agreed at this step (False: a step between agreements)
    #: ``train.val_every_s`` passed on worker 0's clock: all validate here, as the ``validate``-th validation
    #: by time (0: none). Its number travels with the decision: worker 0 may see the next one due before the
    #: workers act on this one (agreements further apart than ``val_every_s``).
    validate: int = 0
    #: Workers were lost after another survivor had passed this agreement (having acted on it, or been cut
    #: off in the action): nothing is done here, not even a checkpoint the step count asks for, which this
    #: worker would take alone; all act together at the first agreement after the loss.
    passed: bool = False


class Control:
    """The workers' agreement on when to checkpoint or stop, without a blocking collective per step.

    Checkpoints are time-based; a stop is asked by ``RUN_DIR/STOP``, written by the launcher on
    SIGTERM/SIGUSR1. Every ``interval`` steps each worker completes the small non-blocking all-reduce (max)
    started ``interval`` steps earlier, on a communicator of its own, and starts the next with worker 0's
    flags. The result is known to all workers at the same step, so they all act on it there. Synchronous
    rules use ``interval`` 1; asynchronous ones a longer one, so workers drift at most that many steps apart.
    """

    def __init__(
        self,
        workers: Comm,
        run_dir: Path,
        checkpointer: Checkpointer,
        interval: int,
        start: int = 0,
        split: bool = True,
    ):
        self.workers, self.stop_file = workers, run_dir / STOP
        self.checkpointer, self.interval = checkpointer, interval
        self.join_file, self.join_unreadable = run_dir / JOIN, False
        self.flags = torch.zeros(4, dtype=torch.float64)
        #: Worker 0, at each agreement: the validation by time now due (``train.val_every_s``), 0 when none
        #: (None: never).
        self.validation_due: Callable[[], int] | None = None
        self.comm: Comm | None = None
        self.next_poll, self.forced, self.request = (start // interval + 1) * interval, False, None
        self.rejoin_at: int | None = None  # the first agreement after workers were lost or joined
        self.seconds = 0.0  # spent deciding (:meth:`poll`), for the summary's control time per step
        if split:  # (not: a worker spawned into the job; it splits with the others when welcomed)
            if workers.rank == 0:
                self.drop_stale_join()
            self.reset(self.next_poll, forced=False)

    def reset(self, next_poll: int, forced: bool = True) -> None:
        """Start over on the workers' communicator as it is now (after workers were lost or joined).

        The communicator is split now (collective: at the first agreement a worker could be blocked in it
        while another waits for it to take a message). The next agreement is after ``next_poll`` steps (the
        same on every worker), and with ``forced`` it decides a checkpoint there."""
        self.comm = self.workers.split(0)
        self.next_poll, self.forced = next_poll, forced
        self.rejoin_at = next_poll if forced else None
        self.request = None

    def poll(self, step: int) -> Decision:
        """Call after every step (``step`` steps done); the decision is the same on every worker."""
        start = time.perf_counter()
        try:
            return self._decide(step)
        finally:
            self.seconds += time.perf_counter() - start

    def _decide(self, step: int) -> Decision:
        if self.rejoin_at is not None and step < self.rejoin_at:
            return Decision(passed=True)
        if step != self.next_poll:
            return Decision()
        self.rejoin_at = None
        self.next_poll += self.interval
        decision = Decision(checkpoint=self.forced, polled=True)
        self.forced = False
        if self.request is not None:
            self.request.wait()
            checkpoint = bool(self.flags[0] > 0) or decision.checkpoint
            stop, join, validate = bool(self.flags[1] > 0), int(self.flags[2]), int(self.flags[3])
            decision = Decision(checkpoint, stop, join, polled=True, validate=validate)
        if self.workers.rank == 0:
            self.flags[0] = float(self.checkpointer.time_due())
            self.flags[1] = float(self.stop_file.exists())
            self.flags[2] = float(self.join_granted())
            self.flags[3] = float(self.validation_due() if self.validation_due is not None else 0)
        else:
            self.flags.zero_()
        self.request = self.comm.iallreduce(self.flags, op="max")
        return decision

    def join_requested(self, take: bool = True) -> int:
        """Worker 0: the workers ``RUN_DIR/JOIN`` asks to add, taken once; 0 without one.

        The file's text is a number (empty: 1). Taking it removes the file; with ``take`` false it is left,
        for :meth:`take_join`. A text that is not a small number is named in one warning and ignored
        (:func:`runner.rank.join_request.join_count`)."""
        try:
            text = read_join(self.join_file)  # (a named pipe or a link there is named, never waited on)
            if take:
                self.join_file.unlink()
        except FileNotFoundError:
            return 0
        except OSError as err:  # (a folder in its place): said once, not at every agreement
            if not self.join_unreadable:
                print(
                    f"warning: {self.join_file} cannot be read ({err.strerror or err}); ignored", flush=True
                )
            self.join_unreadable = True
            return 0
        count, problem = join_count(text)
        if problem is not None:
            if not take:  # no request, so never decided and taken: removed here
                self.take_join()
            print(f"warning: {self.join_file} {problem}; ignored (the file is removed)", flush=True)
        return count

    def join_granted(self, take: bool = True) -> int:
        """Worker 0, at an agreement: :meth:`join_requested`, or 0 when this job cannot grow.

        A refusal is named in one warning (:func:`runner.rank.join_request.growth_refusal`: no fault
        tolerance, or NCCL or gloo)."""
        count = self.join_requested(take)
        refusal = growth_refusal(self.workers) if count else None
        if refusal is not None:
            if not take:
                self.take_join()
            print(f"warning: {self.join_file} refused: {refusal}; the file is removed", flush=True)
            return 0
        return count

    def take_join(self) -> None:
        """Remove ``RUN_DIR/JOIN``: its request was decided."""
        try:
            self.join_file.unlink()
        except OSError:
            pass

    def drop_stale_join(self) -> None:
        """Worker 0, as the job starts: remove a ``RUN_DIR/JOIN`` an earlier job of the run folder left.

        Such a file is older than this job's ``config.yaml``; it is removed so that ``resume=`` does not
        apply an old request."""
        if stale_join(self.join_file.parent, self.join_file):
            self.join_file.unlink(missing_ok=True)
            print(f"warning: {self.join_file} was left by an earlier job: removed, not applied", flush=True)

    def close(self) -> None:
        """Complete the all-reduce in flight (every worker calls this at the same step)."""
        if self.request is not None:
            self.request.wait()
            self.request = None


#: A decision on the board: the meetings passed, shifted past its bits (checkpoint, stop, workers to add).
MEETING_SHIFT = 12
JOIN_MASK = (1 << (MEETING_SHIFT - 2)) - 1


class Board(Control):
    """The workers' agreement without waiting for one another.

    For dynamic assignment under a rule whose workers never wait on each other (ASGD, asynchronous EASGD:
    they validate alone). :class:`Control`'s all-reduce makes a fast worker wait, at every agreement,
    for the slowest to have passed the one before; here the first worker past a meeting decides for all,
    from what it reads itself (``RUN_DIR/STOP``, ``RUN_DIR/JOIN``: the run folder is shared; the checkpoint
    clock), and posts it in one compare-and-swap on the dealer's counter (its slot
    :func:`~runner.rank.assignment.decision_slot`: the meetings passed and the decision's bits); the others
    read it as they pass. A decision that acts (checkpoint, stop, growth) is collective at its meeting,
    so no worker passes it, nor posts a later one, before every worker has read it: a later meeting's
    decision on the board means this one's was to go on."""

    def __init__(
        self, workers: Comm, run_dir: Path, checkpointer: Checkpointer, counter: Callable[[], CounterLike]
    ):
        super().__init__(workers, run_dir, checkpointer, 1, split=False)
        self.counter = counter  # the dealer's, as it is now (a loss deals anew)
        self.forced_at: int | None = None
        if workers.rank == 0:
            self.drop_stale_join()

    def reset(self, next_poll: int, forced: bool = True) -> None:
        """After workers were lost or joined: with ``forced``, a checkpoint at meeting ``next_poll``."""
        self.forced_at = next_poll if forced else None

    def _decide(self, step: int) -> Decision:
        """The decision for the ``step``-th meeting of the run: the one posted for it, or this worker's own.

        Every worker passes each meeting; when none is posted yet, this worker posts its own first."""
        assert self.validation_due is None, "validations by time are claimed on the counter, not agreed"
        if self.forced_at is not None and step < self.forced_at:  # (its decision went with the old counter)
            return Decision(passed=True)
        counter, slot = self.counter(), decision_slot(self.workers.size)
        seen = counter.read(slot)[0]
        while seen >> MEETING_SHIFT < step:  # not decided yet: decide, unless another worker does first
            bits = self._bits()
            mine = (step << MEETING_SHIFT) | bits
            before = counter.compare_and_swap(slot, seen, mine)
            if before == seen:
                if bits >> 2:
                    self.take_join()
                seen = mine
            else:
                seen = before
        bits = seen & ((1 << MEETING_SHIFT) - 1) if seen >> MEETING_SHIFT == step else 0
        forced = self.forced_at == step
        if forced:
            self.forced_at = None
        # agreed alike on every worker, with what each holds (a lost worker to replace): a posted action,
        # or the meeting the survivors of a loss agreed on; one decided to go on, each passes in its time
        agreed = bool(bits) or forced
        return Decision(bool(bits & 1) or forced, bool(bits & 2), bits >> 2, polled=agreed)

    def _bits(self) -> int:
        """This worker's decision for a meeting: checkpoint by time, stop, workers to add.

        The JOIN file is left until the decision is posted."""
        join = min(self.join_granted(take=False), JOIN_MASK)
        return int(self.checkpointer.time_due()) | int(self.stop_file.exists()) << 1 | join << 2

    def close(self) -> None:
        """Nothing is in flight."""
