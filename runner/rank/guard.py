"""Non-finite steps: a NaN or infinity in one rank's loss, gradients, BatchNorm statistics or parameters.

:func:`poisoned` carries a rank's non-finite loss into the gradients it exchanges, so ranks that average
gradients decide alike; :class:`Guard` decides whether a step may be applied (``train.on_nonfinite``: stop
the run as diverged, or skip the step everywhere), keeps the BatchNorm statistics a dropped or redone step
must not leave behind, and refuses to checkpoint a model that is no longer finite. With ``stop`` (and no
fp16 gradient scaler) its checks stay on the device and are read every ``train.log_every`` steps, so a
GPU step needs no host synchronisation. :func:`collapse` calls a run diverged whose validation loss, though
finite, exploded (``train.diverge_at``); :func:`fell_to_chance` one whose classifier ended at chance after
having been well above it (``train.collapse_margin``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from runner.rank.state import Owner

if TYPE_CHECKING:
    from runner.rules.base import Rule


def norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``tensors`` together: finite exactly when every element is (barring overflow)."""
    return torch.nn.utils.get_total_norm(tensors, foreach=True) if tensors else torch.zeros(())


def poisoned(
    loss: torch.Tensor, buffers: list[torch.Tensor], scale: float = 1.0, stats_ok: torch.Tensor | None = None
) -> torch.Tensor:
    """``scale · loss`` while the loss and BatchNorm statistics its forward pass updated are finite, else NaN.

    Backward then gives NaN gradients, so a rule that averages them carries one rank's non-finite step to
    every rank, and all of them decide alike (without a host sync). ``scale`` is the rule's
    :attr:`~runner.rules.base.Rule.loss_scale`, applied in the same multiplication at no cost.
    ``stats_ok``: whether the statistics are finite, when the caller computed it already."""
    ok = torch.isfinite(norm(buffers)) if stats_ok is None else stats_ok
    return loss * torch.where(torch.isfinite(loss) & ok, scale, float("nan"))


class Diverged(RuntimeError):
    """A non-finite loss or gradient, or a validation loss that exploded: the job ends with status diverged.

    Non-finite values end it with ``train.on_nonfinite=stop``; an exploded validation loss, by
    ``train.diverge_at``."""


def collapse(loss: float, first: float, factor: float | None) -> str | None:
    """Why a validation ``loss`` means the run diverged (None: it does not).

    It is not finite, or above ``factor`` times the run's ``first`` validation loss (``factor`` None: only
    when not finite)."""
    if not math.isfinite(loss):
        return f"validation loss {loss}"
    if factor is not None and first > 0 and loss > factor * first:
        return (
            f"validation loss {loss:.4g}, {loss / first:,.0f}x the run's first ({first:.4g}), above "
            f"train.diverge_at={factor:g}"
        )
    return None


def fell_to_chance(
    history: list[dict[str, float]], prefix: str, classes: int | None, margin: float | None
) -> str | None:
    """Why the run's last validation means its classifier of ``classes`` classes collapsed (None: it did not).

    The validations are ``history``, the reported model's keys starting with ``prefix``; None also without a
    margin, class count or accuracy. A collapse is an earlier validation well above chance, accuracy at least
    ``chance + 2·margin·(1 − chance)``, and now either its accuracy within ``chance + margin·(1 − chance)``,
    or its loss above chance level (``ln classes``, a uniform guess's) while its accuracy is no longer well
    above chance."""
    acc_key, loss_key = f"{prefix}val_acc", f"{prefix}val_loss"
    accs = [r[acc_key] for r in history if acc_key in r]
    if margin is None or classes is None or classes < 2 or len(accs) < 2:
        return None
    chance, level = 1 / classes, math.log(classes)
    near, above = chance + margin * (1 - chance), chance + 2 * margin * (1 - chance)
    best, final, loss = max(accs[:-1]), accs[-1], history[-1].get(loss_key)
    lost = final <= near or (loss is not None and loss > level and final < above)
    if best < above or not lost:
        return None
    shown = (
        f", validation loss {loss:.4g} (chance level ln {classes} = {level:.3g})" if loss is not None else ""
    )
    return (
        f"validation accuracy fell from {best:.4g} (its best) to {final:.4g}, near chance ({chance:.3g}, "
        f"1 of {classes} classes){shown}: the model collapsed; lower optim.lr or change the rule's settings, "
        f"or train.collapse_margin=null to end such a run ok (now {margin:g})"
    )


class Guard(Owner):
    """The non-finite checks of one worker's training.

    ``keep`` is whether the BatchNorm statistics are copied before each step (``on_nonfinite=skip``, or fault
    tolerance, which may redo a step); ``fp16`` a gradient scaler is in use, whose overflowing steps are
    skipped without ending the run; ``echo`` prints a line for the run's output; ``rank()`` is this worker's
    rank now (for messages; recovery renumbers).

    With ``on_nonfinite=stop`` and no ``fp16`` the checks are deferred (:attr:`deferred`): each step's
    finiteness is computed on the device, which remembers the first bad step and its cause, and the step is
    applied regardless; :meth:`check` reads it (one host synchronisation) where the loop calls it: every
    ``train.log_every`` steps, before every validation and checkpoint, at each epoch's end and at the end.
    A model past a bad step is never checkpointed, and the run ends naming that first step. ``skip`` and
    fp16 keep a host synchronisation per step: whether to apply the step must be known before it is."""

    STATE = ("skipped", "checkpointed", "overflows")
    TRANSIENT = {
        **dict.fromkeys(("model", "optimizer", "rule", "on_nonfinite", "fp16", "echo", "rank"), "given"),
        **dict.fromkeys(("params", "buffers", "keeping", "deferred"), "follow from what it is given"),
        **dict.fromkeys(
            ("first", "at_first", "stats_ok", "flat"), "deferred checks, read before any state moves"
        ),
        "kept": "the buffers kept for the step in progress",
    }

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
        self.deferred = on_nonfinite == "stop" and not fp16
        #: Deferred, on the device: the first step (0-based) that was not finite, -1 while none was (None
        #: before the first step); its loss, gradient sum or norm, and whether the statistics were finite.
        self.first: torch.Tensor | None = None
        self.at_first: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.stats_ok: torch.Tensor | None = None  # the last forward pass's (deferred, with BatchNorm)
        self.flat = False  # the gradient checked is the sum of the rule's flat buffers (else the norm)
        self.kept: list[torch.Tensor] = []
        self.checkpointed: int | None = None  # the step of the last checkpoint written (or resumed from)
        self.skipped = 0  # steps dropped for a non-finite loss, gradient or statistic
        self.overflows = 0  # fp16 steps skipped because the scaled gradients overflowed

    def allows(self, loss: torch.Tensor, step: int) -> bool:
        """Whether the step may be applied: loss, BatchNorm statistics and gradients finite.

        Otherwise ``on_nonfinite=stop`` raises :class:`Diverged` (deferred: the step is applied, and
        :meth:`check` raises later); ``skip`` drops the step (its update and its BatchNorm statistics) and
        counts it. Rules that exchange gradients (BSP) decide alike on every rank, since a rank's non-finite
        step poisons the gradient it sends. A rule that holds every gradient in a few flat buffers (BSP's
        buckets) has their sums checked, a third cheaper than the norm and as sure: a NaN or infinity
        anywhere makes the sum non-finite."""
        flat = self.rule.grad_buffers()
        if flat:
            grad_norm = torch.stack([b.sum() for b in flat]).sum()
        else:
            grad_norm = norm([p.grad for p in self.params if p.grad is not None])
        if self.deferred:
            self.note(loss, grad_norm, step, bool(flat))
            return True
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
            raise self.diverged(what, step)
        self.skipped += 1
        self.optimizer.zero_grad(set_to_none=False)
        self.restore()
        if self.skipped <= 3 or self.skipped % 100 == 0:
            self.echo(f"step {step + 1}: non-finite {what}, step skipped ({self.skipped} so far)")
        return False

    def poison(self, loss: torch.Tensor, scale: float) -> torch.Tensor:
        """:func:`poisoned`; deferred, it keeps whether the BatchNorm statistics were finite (for note)."""
        if not self.deferred or not self.buffers:
            return poisoned(loss, self.buffers, scale)
        self.stats_ok = torch.isfinite(norm(self.buffers))
        return poisoned(loss, self.buffers, scale, self.stats_ok)

    def note(self, loss: torch.Tensor, grad: torch.Tensor, step: int, flat: bool) -> None:
        """Deferred: remember on the device whether step ``step`` (0-based) was the first that was not finite.

        It does not wait for the device. For such a step it also remembers its loss, gradient and
        statistics."""
        if self.first is None:
            self.first = torch.full((), -1, dtype=torch.int64, device=grad.device)
            ok = torch.ones((), dtype=torch.bool, device=grad.device)
            self.at_first = (torch.zeros_like(loss), torch.zeros_like(grad), ok)
        now = ~torch.isfinite(grad) & (self.first < 0)
        self.first = torch.where(now, step, self.first)
        bad_loss, bad_grad, stats_ok = self.at_first
        stats_ok = stats_ok if self.stats_ok is None else torch.where(now, self.stats_ok, stats_ok)
        self.at_first = (torch.where(now, loss, bad_loss), torch.where(now, grad, bad_grad), stats_ok)
        self.flat = flat

    def check(self) -> None:
        """Deferred: raise :class:`Diverged` if a step since training began was not finite, naming the first.

        One host synchronisation; nothing to do without deferred checks."""
        if self.first is None:
            return
        step = int(self.first)
        if step < 0:
            return
        loss, grad, stats_ok = self.at_first
        if not math.isfinite(float(loss)):
            what = f"loss {float(loss)}"
        elif not bool(stats_ok):
            what = "BatchNorm statistics"
        else:
            what = f"gradient ({'sum' if self.flat else 'norm'} {float(grad)})"
        raise self.diverged(what, step)

    def diverged(self, what: str, step: int) -> Diverged:
        """The error that ends the run at non-finite ``what`` in step ``step`` (0-based)."""
        return Diverged(
            f"non-finite {what} at step {step + 1} on rank {self.rank()}; lower optim.lr, or "
            f"train.on_nonfinite=skip to drop such steps; {self.kept_checkpoint()}"
        )

    @torch.no_grad()
    def keep(self) -> None:
        """Copy the BatchNorm statistics before the forward pass updates them (when keeping).

        Then a dropped or redone step leaves no trace in them either."""
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
        """Raise :class:`Diverged` when the model is no longer finite.

        A finite gradient times a large learning rate can overflow a parameter, large activations a
        BatchNorm statistic. First, with deferred checks, it raises when a step since the last check was not
        finite (:meth:`check`)."""
        self.check()
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
