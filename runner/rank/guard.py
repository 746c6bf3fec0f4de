"""Non-finite steps: a NaN or infinity in one rank's loss, gradients, BatchNorm statistics or parameters.

:func:`poisoned` carries a rank's non-finite loss into the gradients it exchanges, so ranks that average
gradients decide alike; :class:`Guard` decides before each optimizer step whether the step may be applied
(``train.on_nonfinite``: stop the run as diverged, or skip the step everywhere), keeps the BatchNorm
statistics a dropped or redone step must not leave behind, and refuses to checkpoint a model that is no
longer finite. :func:`collapse` calls a run diverged whose validation loss, though finite, exploded
(``train.diverge_at``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from runner.rules.base import Rule


def norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``tensors`` together: finite exactly when every element is (barring overflow)."""
    return torch.nn.utils.get_total_norm(tensors, foreach=True) if tensors else torch.zeros(())


def poisoned(loss: torch.Tensor, buffers: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """``scale · loss`` while the loss and the BatchNorm statistics its forward pass updated are finite, else
    NaN: backward then gives NaN gradients, so a rule that averages them carries one rank's non-finite step
    to every rank, and all of them decide alike (without a host sync). ``scale`` is the rule's
    :attr:`~runner.rules.base.Rule.loss_scale`, applied in the same multiplication at no cost."""
    ok = torch.isfinite(loss) & torch.isfinite(norm(buffers))
    return loss * torch.where(ok, scale, float("nan"))


class Diverged(RuntimeError):
    """A non-finite loss or gradient with ``train.on_nonfinite=stop``, or a validation loss that exploded
    (``train.diverge_at``): the job ends with status diverged."""


def collapse(loss: float, first: float, factor: float | None) -> str | None:
    """Why a validation ``loss`` means the run diverged (None: it does not): not finite, or above
    ``factor`` times the run's ``first`` validation loss (``factor`` None: only when not finite)."""
    if not math.isfinite(loss):
        return f"validation loss {loss}"
    if factor is not None and first > 0 and loss > factor * first:
        return (
            f"validation loss {loss:.4g}, {loss / first:,.0f}x the run's first ({first:.4g}), above "
            f"train.diverge_at={factor:g}"
        )
    return None


class Guard:
    """The non-finite checks of one worker's training. ``keep`` is whether the BatchNorm statistics are
    copied before each step (``on_nonfinite=skip``, or fault tolerance, which may redo a step); ``fp16`` a
    gradient scaler is in use, whose overflowing steps are skipped without ending the run; ``echo`` prints
    a line for the run's output; ``rank()`` is this worker's rank now (for messages; recovery renumbers)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rule: Rule,
        on_nonfinite: str,
        keep: bool,
        fp16: bool,
        echo: Callable[[str], None],
        rank: Callable[[], int],
    ):
        self.model, self.optimizer, self.rule, self.on_nonfinite = model, optimizer, rule, on_nonfinite
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.keeping, self.fp16, self.echo, self.rank = keep and bool(self.buffers), fp16, echo, rank
        self.kept: list[torch.Tensor] = []
        self.checkpointed: int | None = None  # the step of the last checkpoint written (or resumed from)
        self.skipped = 0  # steps dropped for a non-finite loss, gradient or statistic
        self.overflows = 0  # fp16 steps skipped because the scaled gradients overflowed

    def allows(self, loss: torch.Tensor, step: int) -> bool:
        """Whether the step may be applied: loss, BatchNorm statistics and gradients finite. Otherwise
        ``on_nonfinite=stop`` raises :class:`Diverged`; ``skip`` drops the step (its update and its
        BatchNorm statistics) and counts it. Rules that exchange gradients (BSP) decide alike on every rank,
        since a rank's non-finite step poisons the gradient it sends. A rule that holds every gradient in a
        few flat buffers (BSP's buckets) has their sums checked, a third cheaper than the norm and as sure:
        a NaN or infinity anywhere makes the sum non-finite."""
        flat = self.rule.grad_buffers()
        if flat:
            grad_norm = torch.stack([b.sum() for b in flat]).sum()
        else:
            grad_norm = norm([p.grad for p in self.params if p.grad is not None])
        if bool(torch.isfinite(grad_norm)):
            return True
        if self.fp16 and bool(torch.isfinite(loss)):
            self.overflows += 1
            self.optimizer.zero_grad(set_to_none=False)
            return False
        if not bool(torch.isfinite(loss)):
            what = f"loss {loss.item()}"
        elif not bool(torch.isfinite(norm(self.buffers))):
            what = "BatchNorm statistics"
        else:
            what = f"gradient ({'sum' if flat else 'norm'} {grad_norm.item()})"
        if self.on_nonfinite == "stop":
            raise Diverged(
                f"non-finite {what} at step {step + 1} on rank {self.rank()}; lower optim.lr, or "
                f"train.on_nonfinite=skip to drop such steps; {self.kept_checkpoint()}"
            )
        self.skipped += 1
        self.optimizer.zero_grad(set_to_none=False)
        self.restore()
        if self.skipped <= 3 or self.skipped % 100 == 0:
            self.echo(f"step {step + 1}: non-finite {what}, step skipped ({self.skipped} so far)")
        return False

    @torch.no_grad()
    def keep(self) -> None:
        """Copy the BatchNorm statistics before the forward pass updates them (when keeping), so that a
        dropped or redone step leaves no trace in them either."""
        if not self.keeping:
            return
        if not self.kept:
            self.kept = [b.clone() for b in self.buffers]
        for kept, buffer in zip(self.kept, self.buffers, strict=True):
            kept.copy_(buffer)

    @torch.no_grad()
    def restore(self) -> None:
        for buffer, kept in zip(self.buffers, self.kept, strict=True):
            buffer.copy_(kept)

    def check_model(self, step: int) -> None:
        """Raise :class:`Diverged` when the model is no longer finite (a finite gradient times a large
        learning rate can overflow a parameter, large activations a BatchNorm statistic)."""
        state = self.model.state_dict()
        tensors = [t for t in state.values() if t.is_floating_point()]
        if not bool(torch.isfinite(norm(tensors))):
            bad = next(k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all())
            raise Diverged(
                f"non-finite {bad} after step {step} on rank {self.rank()}; lower optim.lr; "
                + self.kept_checkpoint()
            )

    def kept_checkpoint(self) -> str:
        """What of the run is kept when it diverges now, for the message."""
        if self.checkpointed is None:
            return "no checkpoint was written before it"
        return f"its last good checkpoint (after step {self.checkpointed}) is kept"
