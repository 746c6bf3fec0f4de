"""The loop's side of surviving lost workers.

What :class:`~runner.rank.resilience.recovery.Recovery` asks of the training loop (its
:class:`~runner.rank.resilience.recovery.Survivor` protocol)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from runner.comm.face import CommLike
    from runner.rank.resilience.crew import Crew
    from runner.rank.resilience.growth import Growth
    from runner.rank.state import Position


class Survivors:
    """The survivor protocol of one worker.

    Recovery calls these, collectively over the surviving workers, wherever they were when the loss
    surfaced. ``save(pos, end)``: the loop's checkpoint."""

    def __init__(self, crew: Crew, save: Callable[[Position, bool], None], growth: Growth):
        self.crew, self._save, self.growth = crew, save, growth

    @property
    def synchronous(self) -> bool:
        """Whether the rule's workers step together (then they agree on one step to continue from)."""
        return self.crew.rule.synchronous

    def abandon(self) -> None:
        """Complete or forget the rule's communication in flight (the communicator is revoked)."""
        self.crew.rule.abandon()

    def save(self, pos: Position, end: bool) -> None:
        """Checkpoint (collective over the workers)."""
        self._save(pos, end)

    def share_state(self, comm: CommLike, root: int) -> Any:
        """Give every survivor ``root``'s model, and return ``root``'s optimizer, rule and scaler states."""
        return self.crew.state.share(comm, root)

    def adopt(self, state: Any) -> None:
        """Take the states :meth:`share_state` returned (this survivor was behind)."""
        self.crew.state.adopt(state)

    def rejoin(self, val_loader: Any, next_poll: int, before: list[int], lost: list[int]) -> None:
        """Go on over the survivors: the rule's own recovery, the validation share and the next agreement.

        With dynamic assignment the lost workers' data goes back to the pool too."""
        self.crew.rule.recover()
        self.crew.validator.resend(record=before[0] not in lost)
        self.crew.validator.val_loader = val_loader
        self.crew.control.reset(next_poll)
        self.crew.meter.world = self.crew.workers.size
        self.crew.pace.rejoin(before, lost)  # dynamic assignment: the lost workers' chunks back to the pool

    def agreement_after(self, step: int) -> int:
        """The first step after ``step`` at which the workers agree on checkpoints and stops."""
        return self.crew.pace.agreement_after(step)

    def joins_agreed(self) -> int:
        """The workers ``RUN_DIR/JOIN`` asked for that the workers agreed to add and have not added yet."""
        return self.growth.joins_agreed()

    def put_off_growth(self, joins: int) -> None:
        """A growth agreed and not under way waits for the agreement the recovery forces."""
        self.growth.put_off(joins)

    def record_failure(self, step: int, lost: list[int], seconds: float, line: str, terminal: TextIO) -> None:
        """Record the loss in the run's records and on the console (the new rank 0 takes them over)."""
        if not self.crew.log.enabled:  # the lowest survivor is the new rank 0: it takes the records over
            self.crew.log.take_over()
            self.crew.meter.terminal = terminal
        size = self.crew.workers.size
        self.crew.log.write("failure", step, lost=lost, workers=size, recovery_s=round(seconds, 4))
        self.crew.meter.echo(line)
