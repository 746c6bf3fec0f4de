"""The loop's side of surviving lost workers: what :class:`~runner.rank.resilience.recovery.Recovery` asks of
the training loop (its :class:`~runner.rank.resilience.recovery.Survivor` protocol), for a
:class:`~runner.rank.loop.Loop`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from runner.comm import Comm
    from runner.rank.face import Loop
    from runner.rank.state import Position


class Survivors:
    """The survivor protocol of one worker's loop (``loop``): recovery calls these, collectively over the
    surviving workers, wherever they were when the loss surfaced."""

    def __init__(self, loop: Loop):
        self.loop = loop

    @property
    def synchronous(self) -> bool:
        """Whether the rule's workers step together (then they agree on one step to continue from)."""
        return self.loop.rule.synchronous

    def abandon(self) -> None:
        """Complete or forget the rule's communication in flight (the communicator is revoked)."""
        self.loop.rule.abandon()

    def save(self, pos: Position, end: bool) -> None:
        """Checkpoint (collective over the workers)."""
        self.loop.save(pos, end)

    def share_state(self, comm: Comm, root: int) -> Any:
        """Give every survivor ``root``'s model, and return ``root``'s optimizer, rule and scaler states."""
        return self.loop.state.share(comm, root)

    def adopt(self, state: Any) -> None:
        """Take the states :meth:`share_state` returned (this survivor was behind)."""
        self.loop.state.adopt(state)

    def rejoin(self, val_loader: Any, next_poll: int, before: list[int], lost: list[int]) -> None:
        """Go on over the survivors: the rule's own recovery, the validation share, the next agreement, and
        (dynamic assignment) the lost workers' data back to the pool."""
        loop = self.loop
        loop.rule.recover()
        loop.validator.resend(record=before[0] not in lost)
        loop.validator.val_loader = val_loader
        loop.control.reset(next_poll)
        loop.meter.world = loop.workers.size
        loop.pace.rejoin(before, lost)  # dynamic assignment: the lost workers' chunks back to the pool

    def agreement_after(self, step: int) -> int:
        """The first step after ``step`` at which the workers agree on checkpoints and stops."""
        return self.loop.pace.agreement_after(step)

    def record_failure(self, step: int, lost: list[int], seconds: float, line: str, terminal: TextIO) -> None:
        """Record the loss in the run's records and on the console (the new rank 0 takes them over)."""
        loop = self.loop
        if not loop.log.enabled:  # the lowest survivor is the new rank 0: it takes the records over
            loop.log.take_over()
            loop.meter.terminal = terminal
        loop.log.write("failure", step, lost=lost, workers=loop.workers.size, recovery_s=round(seconds, 4))
        loop.meter.echo(line)
