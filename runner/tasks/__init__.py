"""Tasks: one module per ``conf/task`` option.

A task decides the training loss and the validation metrics, and checks on the first batch that the model's
outputs and the data's targets fit it.

The schema (:class:`TaskConfig`) is read by the launcher and imports no torch; :class:`Task`, what the
training loop and the evaluation use, imports torch when first called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from runner.lazy import lazy_import
from runner.schema.target import Target

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")

#: Metrics that improve upwards; every other one (loss, mae, ppl...) improves downwards.
HIGHER_IS_BETTER = ("acc", "top5")


def maximized(metric: str) -> bool:
    """Whether a larger value of ``metric`` (``val_acc``, ``center_val_loss``...) is better."""
    return metric.rsplit("_", 1)[-1] in HIGHER_IS_BETTER


def describe(x: torch.Tensor) -> str:
    return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}"


@dataclass
class TaskConfig:
    """Base of the tasks' schemas.

    ``loss``: any loss given by its class, ``{_target_: torch.nn.HuberLoss, delta: 0.5}``, called as
    ``loss(outputs, targets)`` and returning the batch mean, instead of the task's own; the metrics stay the
    task's."""

    loss: Any = None

    #: The metrics validation reports, each as ``val_<name>``; the first is the default ``train.monitor``.
    METRICS: ClassVar[tuple[str, ...]] = ("loss",)

    def __post_init__(self) -> None:
        if self.loss is not None and not isinstance(self.loss, Target):
            self.loss = Target.of("loss", self.loss, group="task")

    def metrics(self, num_classes: int | None) -> tuple[str, ...]:
        """The validation metrics (without ``val_``) for a data set of ``num_classes`` classes."""
        return self.METRICS

    def tokens_per_sample(self, shape: list[int]) -> int | None:
        """Tokens in a sample of ``shape`` (the data set's); None where the task counts no tokens."""
        return None

    def build(self, num_classes: int | None = None) -> Task:
        """The task, for a data set of ``num_classes`` classes (None: not known)."""
        raise NotImplementedError

    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The loss given by ``loss``, or None for the task's own."""
        return self.loss.build() if self.loss is not None else None


class Task:
    """What the loop asks of a task: its loss, a check of the first batch, and the validation's sums.

    The training ``loss``, a ``check`` of the first batch, and per batch the ``sums`` that validation adds
    over all ranks and turns into metrics with ``results``.

    ``sums`` returns 0-dim tensors (no host synchronisation per batch): the loss summed over the counted items
    (the batch mean times their number), then the task's own sums, then the count last: ``width`` values,
    whatever the batch."""

    width: int = 3

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        self.custom = loss

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.custom(out, y) if self.custom is not None else self.default_loss(out, y)

    def default_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Raise ValueError when outputs and targets do not fit the task (called on the first batch)."""

    def sums(self, out: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def results(self, sums: list[float]) -> dict[str, float]:
        """``{metric: value}`` from the ``sums`` added over the whole validation set."""
        raise NotImplementedError
