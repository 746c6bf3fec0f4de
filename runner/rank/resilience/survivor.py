"""The loop's side of surviving lost workers: what :class:`~runner.rank.resilience.recovery.Recovery` asks of
the training loop (its :class:`~runner.rank.resilience.recovery.Survivor` protocol)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from runner.comm.face import CommLike
    from runner.rank.agreement import Control
    from runner.rank.pace import Pace
    from runner.rank.records.meter import Meter
    from runner.rank.records.metrics import MetricsLog
    from runner.rank.state import Position
    from runner.rank.trainer_state import TrainerState
    from runner.rank.validator import Validator
    from runner.rules.base import Rule


class Survivors:
    """The survivor protocol of one worker: recovery calls these, collectively over the surviving workers,
    wherever they were when the loss surfaced. ``save(pos, end)``: the loop's checkpoint."""

    def __init__(
        self,
        *,
        workers: CommLike,
        rule: Rule,
        state: TrainerState,
        pace: Pace,
        validator: Validator,
        control: Control,
        meter: Meter,
        log: MetricsLog,
        save: Callable[[Position, bool], None],
    ):
        self.workers, self.rule, self.state, self.pace = workers, rule, state, pace
        self.validator, self.control, self.meter, self.log = validator, control, meter, log
        self._save = save

    @property
    def synchronous(self) -> bool:
        """Whether the rule's workers step together (then they agree on one step to continue from)."""
        return self.rule.synchronous

    def abandon(self) -> None:
        """Complete or forget the rule's communication in flight (the communicator is revoked)."""
        self.rule.abandon()

    def save(self, pos: Position, end: bool) -> None:
        """Checkpoint (collective over the workers)."""
        self._save(pos, end)

    def share_state(self, comm: CommLike, root: int) -> Any:
        """Give every survivor ``root``'s model, and return ``root``'s optimizer, rule and scaler states."""
        return self.state.share(comm, root)

    def adopt(self, state: Any) -> None:
        """Take the states :meth:`share_state` returned (this survivor was behind)."""
        self.state.adopt(state)

    def rejoin(self, val_loader: Any, next_poll: int, before: list[int], lost: list[int]) -> None:
        """Go on over the survivors: the rule's own recovery, the validation share, the next agreement, and
        (dynamic assignment) the lost workers' data back to the pool."""
        self.rule.recover()
        self.validator.resend(record=before[0] not in lost)
        self.validator.val_loader = val_loader
        self.control.reset(next_poll)
        self.meter.world = self.workers.size
        self.pace.rejoin(before, lost)  # dynamic assignment: the lost workers' chunks back to the pool

    def agreement_after(self, step: int) -> int:
        """The first step after ``step`` at which the workers agree on checkpoints and stops."""
        return self.pace.agreement_after(step)

    def record_failure(self, step: int, lost: list[int], seconds: float, line: str, terminal: TextIO) -> None:
        """Record the loss in the run's records and on the console (the new rank 0 takes them over)."""
        if not self.log.enabled:  # the lowest survivor is the new rank 0: it takes the records over
            self.log.take_over()
            self.meter.terminal = terminal
        size = self.workers.size
        self.log.write("failure", step, lost=lost, workers=size, recovery_s=round(seconds, 4))
        self.meter.echo(line)
