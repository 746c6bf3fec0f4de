"""The workers' agreement: at the same step on every worker, whether to checkpoint, stop, grow or validate.

:class:`Control` reaches it without a blocking collective per step (a small non-blocking all-reduce of
worker 0's flags, completed an interval later); :class:`Decision` is what it decides. Worker 0 reads the
launcher's requests for it: ``RUN_DIR/STOP`` (checkpoint and stop) and ``RUN_DIR/JOIN`` (add workers,
:mod:`runner.rank.join_request`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.lazy import lazy_import
from runner.rank.join_request import JOIN_READ, growth_refusal, join_count, stale_join
from runner.run_folder import JOIN, STOP

if TYPE_CHECKING:
    import torch

    from runner.comm import Comm
    from runner.rank.checkpoint import Checkpointer
else:
    torch = lazy_import("torch")


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


class Control:
    """The workers' agreement on when to checkpoint (time-based) or stop (``RUN_DIR/STOP``, written by the
    launcher on SIGTERM/SIGUSR1), without a blocking collective per step.

    Every ``interval`` steps each worker completes the small non-blocking all-reduce (max) started
    ``interval`` steps earlier, on a communicator of its own, and starts the next with worker 0's flags.
    The result is known to all workers at the same step, so they all act on it there. Synchronous rules
    use ``interval`` 1; asynchronous ones a longer one, so workers drift at most that many steps apart.
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
        if split:  # (not: a worker spawned into the job; it splits with the others when welcomed)
            if workers.rank == 0:
                self.drop_stale_join()
            self.reset(self.next_poll, forced=False)

    def reset(self, next_poll: int, forced: bool = True) -> None:
        """Start over on the workers' communicator as it is now (after workers were lost or joined), split
        now (collective: at the first agreement a worker could be blocked in it while another waits for it
        to take a message): the next agreement is after ``next_poll`` steps (the same on every worker), and
        with ``forced`` it decides a checkpoint there."""
        self.comm = self.workers.split(0)
        self.next_poll, self.forced = next_poll, forced
        self.request = None

    def poll(self, step: int) -> Decision:
        """Call after every step (``step`` steps done); the decision is the same on every worker."""
        if step != self.next_poll:
            return Decision()
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

    def join_requested(self) -> int:
        """Worker 0: the workers ``RUN_DIR/JOIN`` asks to add (its text, a number; empty: 1), taken once
        (the file is removed); 0 without one. A text that is not a small number is named in one warning and
        ignored (:func:`runner.rank.join_request.join_count`)."""
        try:
            with open(self.join_file, "rb") as f:
                text = f.read(JOIN_READ).decode(errors="replace")
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
            print(f"warning: {self.join_file} {problem}; ignored (the file is removed)", flush=True)
        return count

    def join_granted(self) -> int:
        """Worker 0, at an agreement: :meth:`join_requested`, refused in one warning (0) when this job cannot
        grow (:func:`runner.rank.join_request.growth_refusal`: no fault tolerance, or NCCL or gloo)."""
        count = self.join_requested()
        refusal = growth_refusal(self.workers) if count else None
        if refusal is not None:
            print(f"warning: {self.join_file} refused: {refusal}; the file is removed", flush=True)
            return 0
        return count

    def drop_stale_join(self) -> None:
        """Worker 0, as the job starts: remove a ``RUN_DIR/JOIN`` an earlier job of the run folder left
        (older than this job's ``config.yaml``), so that ``resume=`` does not apply an old request."""
        if stale_join(self.join_file.parent, self.join_file):
            self.join_file.unlink(missing_ok=True)
            print(f"warning: {self.join_file} was left by an earlier job: removed, not applied", flush=True)

    def close(self) -> None:
        """Complete the all-reduce in flight (every worker calls this at the same step)."""
        if self.request is not None:
            self.request.wait()
            self.request = None
